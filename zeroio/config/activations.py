"""Activation memory of a Llama: the planner's model of what one micro batch keeps alive.

A fit to a measured run, not a derivation; ``zeroio.estimate`` and ``zeroio.plan`` count it
as the activation row, and benchmarks/probe_largest.py sizes its tries with it.
"""

from __future__ import annotations

from zeroio.errors import ConfigError

ACT_PER_TOKEN_LAYER = (30, 6)
"""Activation bytes per token and decoder layer of a Llama under bf16 without activation
checkpointing: 30 x hidden + 6 x intermediate, fitted to zeroio stage 3 + cpu on the H200
(1.364B, hidden 2048, intermediate 5632, 24 layers, 8 x 1024 tokens: peak 22.8 GiB, of which
~2.7 GB live parameters and buckets, ~2.6 GB logits); the logits add 10 x vocab bytes per
token (bf16 logits, their fp32 copy and its gradient)."""



def llama_activation_bytes(*, hidden: int, intermediate: int, layers: int, vocab: int,
                           seq: int, micro_batch: int) -> int:
    """Activation bytes of one micro batch of a Llama in bf16 without activation checkpointing
    (``ACT_PER_TOKEN_LAYER``: a fit to a measured run, not a derivation)."""
    a, c = ACT_PER_TOKEN_LAYER
    tokens = seq * micro_batch
    return tokens * (layers * (a * hidden + c * intermediate) + 10 * vocab)


def planned_activation_bytes(*, layers, hidden, vocab, intermediate, seq, micro_batch) -> int:
    """``llama_activation_bytes`` with its inputs checked (ConfigError naming the bad one), 0
    when the shape is not given at all (the planner's caller did not say)."""
    given = {"layers": layers, "hidden": hidden, "vocab": vocab}
    if all(v is None for v in given.values()):
        return 0
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{k} = {v!r}: activations need layers, hidden and vocab as "
                              "positive integers (or none of them)", key=k)
    for k, v in {"seq": seq, "micro_batch": micro_batch}.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{k} = {v!r}: expected a positive integer", key=k)
    return llama_activation_bytes(hidden=hidden, intermediate=intermediate or 4 * hidden,
                                  layers=layers, vocab=vocab, seq=seq, micro_batch=micro_batch)


__all__ = ["ACT_PER_TOKEN_LAYER", "llama_activation_bytes", "planned_activation_bytes"]
