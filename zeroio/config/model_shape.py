"""The shape of a Llama-style decoder: its parameter count, and its ``config.json`` read as
plain JSON (no torch, no transformers). ``zeroio.estimate`` re-exports these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zeroio import jsonlimits
from zeroio.errors import ConfigError


def llama_num_params(*, hidden: int, intermediate: int, layers: int, vocab: int, heads: int,
                     kv_heads: int | None = None, head_dim: int | None = None,
                     tied: bool = False, attention_bias: bool = False,
                     mlp_bias: bool = False) -> tuple[int, int]:
    """(parameters, parameters of one decoder layer) of a Llama-style decoder: q/k/v/o
    projections (grouped-query: ``kv_heads`` key/value heads of ``head_dim``), a gated MLP of
    three matrices, two RMSNorm weights per layer, a final norm, the embedding and (unless
    ``tied``) the output head."""
    kv = kv_heads or heads
    hd = head_dim or hidden // heads
    attn = 2 * hidden * heads * hd + 2 * hidden * kv * hd
    if attention_bias:
        attn += heads * hd + 2 * kv * hd + hidden
    mlp = 3 * hidden * intermediate + ((2 * intermediate + hidden) if mlp_bias else 0)
    layer = attn + mlp + 2 * hidden
    return layers * layer + vocab * hidden * (1 if tied else 2) + hidden, layer


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder read from a Hugging Face ``config.json`` (no transformers)."""

    source: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    num_params: int
    layer_params: int


def model_shape(path: str) -> ModelShape:
    """Read ``config.json`` (or a folder holding one) of a Llama-style model: vocab_size,
    hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, tie_word_embeddings (default false, Llama's),
    attention_bias, mlp_bias. Plain JSON: no torch, no transformers."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"--model-config {p} does not exist; pass a config.json or the model "
                          "folder holding one", key="model_config")
    try:
        raw = jsonlimits.loads(p.read_text(encoding="utf-8"), f"--model-config {p}")
    except jsonlimits.JSONLimitError as e:
        raise ConfigError(str(e), key="model_config") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--model-config {p} is not a JSON file: {e}", key="model_config") \
            from None
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else raw  # multimodal wrappers
    if not isinstance(raw, dict):
        raise ConfigError(f"--model-config {p} must hold a JSON object", key="model_config")

    def need(key: str) -> int:
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--model-config {p}: {key} is {v!r}; expected a positive "
                              "integer (a Llama-style decoder config)", key=f"model_config.{key}")
        return v

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv = raw.get("num_key_value_heads") or heads
    hd = raw.get("head_dim") or hidden // heads
    shape = dict(hidden=hidden, intermediate=need("intermediate_size"),
                 layers=need("num_hidden_layers"), vocab=need("vocab_size"), heads=heads,
                 kv_heads=int(kv), head_dim=int(hd), tied=bool(raw.get("tie_word_embeddings",
                                                                        False)))
    total, layer = llama_num_params(**shape, attention_bias=bool(raw.get("attention_bias")),
                                    mlp_bias=bool(raw.get("mlp_bias")))
    return ModelShape(source=str(p), num_params=total, layer_params=layer, **shape)
