"""The tiny Hugging Face Llama the stage-3 and offload_optimizer.ratio tests train, its data,
and the plain-PyTorch reference run on it.

Tied embeddings (one parameter behind two names: the case DeepSpeed's stage 3 gets wrong most
easily), grouped-query attention and, by default, gradient checkpointing (the forward runs
twice per backward, so every gather happens twice). Free of zeroio imports, as
zeroio.testing.reference is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroio.testing.reference import adamw_reference

VOCAB = 128
SEQ = 12
"""Tokens per sample of ``token_batches``."""


def tiny_llama(*, layers: int = 2, checkpointing: bool = True) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of hidden size 32 (~25k parameters at 2 layers), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=64, tie_word_embeddings=True, use_cache=False)
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def token_batches(world: int, *, steps: int, gas: int, micro: int,
                  seed: int = 1234) -> list[list[torch.Tensor]]:
    """``steps`` optimizer steps of ``gas`` micro steps; each micro step a ``(world, micro,
    SEQ)`` tensor of token ids whose row ``r`` is rank r's micro-batch (the reference trains
    on the whole tensor: the global micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (world, micro, SEQ), generator=g) for _ in range(gas)]
            for _ in range(steps)]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Causal LM loss over every rank's rows of one micro step of ``token_batches``."""
    batch = ids.reshape(-1, ids.shape[-1])
    return model(input_ids=batch, labels=batch).loss


def llama_reference(batches: list[list[torch.Tensor]], init: dict[str, torch.Tensor], *,
                    lr: float, clip: float, weight_decay: float = 0.01, layers: int = 2,
                    param_groups: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``adamw_reference`` on a ``tiny_llama(layers=layers)`` loaded with ``init``;
    ``param_groups(model)``, when given, makes AdamW's parameter groups."""
    model = tiny_llama(layers=layers)
    model.load_state_dict(init)
    groups: Iterable[Any] | None = param_groups(model) if param_groups is not None else None
    return adamw_reference(model, batches, lm_loss, lr=lr, weight_decay=weight_decay, clip=clip,
                           param_groups=groups)
