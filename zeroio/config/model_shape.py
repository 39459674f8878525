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


MODEL_TYPES = ("llama",)
"""``model_type`` values zeroio builds (``zeroio train``: ``LlamaForCausalLM``) and counts
(``zeroio estimate``: ``llama_num_params``); a config without one is read as Llama's."""


def read_model_config(path: str) -> tuple[dict, ModelShape]:
    """``(raw, shape)`` of ``config.json`` (or a folder holding one): the file's JSON object
    and its shape, checked by ``check_model_config``. ConfigError naming --model-config."""
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
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--model-config {p} is not valid JSON: {e}", key="model_config") \
            from None
    return raw, check_model_config(raw, str(p))


def model_shape(path: str) -> ModelShape:
    """The shape of ``config.json`` (or a folder holding one) of a Llama-style model, read as
    plain JSON: no torch, no transformers (``read_model_config``)."""
    return read_model_config(path)[1]


def check_model_config(raw, source: str) -> ModelShape:
    """The one check of a model config, used by `zeroio estimate`, `zeroio train` (planned or
    not) alike: a JSON object (a multimodal wrapper's ``text_config``) of ``model_type``
    "llama" (or none) with vocab_size, hidden_size, intermediate_size, num_hidden_layers and
    num_attention_heads positive integers; hidden_size a multiple of the heads (as transformers
    requires), num_key_value_heads (default: the heads) dividing them, head_dim (default
    hidden / heads) and max_position_embeddings positive when given; tie_word_embeddings
    (default false, Llama's), attention_bias, mlp_bias. Its shape, or a ConfigError naming
    ``source`` and the key."""
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else raw  # multimodal wrappers
    if not isinstance(raw, dict):
        raise ConfigError(f"--model-config {source} must hold a JSON object", key="model_config")

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"--model-config {source}: {key} is {raw.get(key)!r}; {why}",
                           key=f"model_config.{key}")

    def need(key: str, default=None) -> int:
        v = raw.get(key)
        if v is None and default is not None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(key, "expected a positive integer (a Llama-style decoder config)")
        return v

    if raw.get("model_type", "llama") not in MODEL_TYPES:
        raise bad("model_type", f"zeroio trains and estimates Llama-style decoders (model_type "
                  f"{' or '.join(map(repr, MODEL_TYPES))}); pass such a config")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if hidden % heads:
        raise bad("hidden_size", f"it must be a multiple of num_attention_heads ({heads})")
    kv = need("num_key_value_heads", heads)
    if heads % kv:
        raise bad("num_key_value_heads", f"it must divide num_attention_heads ({heads})")
    need("max_position_embeddings", 1)
    shape = dict(hidden=hidden, intermediate=need("intermediate_size"),
                 layers=need("num_hidden_layers"), vocab=need("vocab_size"), heads=heads,
                 kv_heads=kv, head_dim=need("head_dim", hidden // heads),
                 tied=bool(raw.get("tie_word_embeddings", False)))
    total, layer = llama_num_params(**shape, attention_bias=bool(raw.get("attention_bias")),
                                    mlp_bias=bool(raw.get("mlp_bias")))
    return ModelShape(source=source, num_params=total, layer_params=layer, **shape)
