"""Model presets for `zeroio train`: Llama-style decoder shapes from a few hundred K to 13B parameters.

A preset is only a shape; the model is always ``transformers.LlamaForCausalLM``
built from a ``LlamaConfig``, so the consolidated output loads with
``AutoModelForCausalLM.from_pretrained`` and nothing zeroio-specific.
The small presets use the byte vocabulary (256); the large ones keep Llama's
32000 so their parameter counts match the models people know (byte ids are a
subset of it).
"""

from __future__ import annotations

from pathlib import Path

from zeroio.errors import ConfigError

# name -> (hidden, layers, intermediate, heads, vocab); kv heads = heads (no GQA).
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 2, 256, 4, 256),  # ~0.4M: the CPU default, seconds per step
    "small": (256, 4, 688, 8, 256),  # ~3.3M
    "125m": (768, 12, 2048, 12, 32000),
    "350m": (1024, 24, 2816, 16, 32000),
    "1b": (2048, 24, 5632, 16, 32000),  # ~1.36B
    "7b": (4096, 32, 11008, 32, 32000),
    "13b": (5120, 40, 13824, 40, 32000),
}
DEFAULT_PRESET = "tiny"
MAX_POSITIONS = 2048


def llama_config(preset: str | None = None, model_config: str | Path | None = None):
    """A ``LlamaConfig`` for a preset name or a config.json path (exactly one, or neither = tiny).
    A config.json is checked by ``check_model_config`` first, the check `zeroio estimate`
    makes, then built by transformers; either one's refusal is a ConfigError naming the file."""
    from transformers import LlamaConfig

    from zeroio.config.model_shape import read_model_config

    if preset is not None and model_config is not None:
        raise ConfigError("give --preset or --model-config, not both", key="preset")
    if model_config is not None:
        raw, shape = read_model_config(str(model_config))
        try:
            return LlamaConfig.from_dict(raw.get("text_config", raw))
        except (ValueError, TypeError) as e:  # what transformers' own checks refuse
            raise ConfigError(f"--model-config {shape.source}: transformers refuses it: "
                              f"{str(e).strip().splitlines()[-1]}", key="model_config") from None
    name = DEFAULT_PRESET if preset is None else preset
    try:
        hidden, layers, inter, heads, vocab = PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown --preset {name!r}; choose one of {', '.join(PRESETS)} or pass --model-config",
            key="preset",
        ) from None
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def num_parameters(config) -> int:
    """Parameter count of a Llama config, from its shape alone (no model is built)."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h  # two RMSNorm weights
    emb = v * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + emb + h  # final norm
