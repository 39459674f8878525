"""The tiny Hugging Face Llama the stage-3 and offload_optimizer.ratio tests train, its data,
its stage-3 config and the plain-PyTorch reference run on it.

Tied embeddings (one parameter behind two names: the case DeepSpeed's stage 3 gets wrong most
easily), grouped-query attention and, by default, gradient checkpointing (the forward runs
twice per backward, so every gather happens twice). Free of zeroio imports, as
zeroio.testing.reference is.
"""

from __future__ import annotations

import os
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


SMALL_STAGE3 = {"sub_group_size": 3000, "stage3_prefetch_bucket_size": 6000,
                "stage3_max_live_parameters": 30000, "stage3_max_reuse_distance": 5000}
"""Stage-3 sizes that split ``tiny_llama`` into several groups, prefetches and releases."""


def stage3_config(*, micro: int, gas: int, clip: float, lr: float, zero: dict,
                  **top: Any) -> dict:
    """A DeepSpeed-style config: AdamW (weight decay 0.01) with clipping, stage 3 with the
    ``zero`` keys, and the ``top`` keys (e.g. ``bf16``) at the top level."""
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, **zero},
        **top,
    }


def offload_param(device: str, nvme_dir: str | None = None) -> dict:
    """``offload_param``; nvme: files under ``nvme_dir/param``, buffers of 40 000 elements
    (>= 3 fp32 layer shards at world 1) and ``max_in_cpu`` 0, so every shard swaps through
    the buffers (DeepSpeed's default 1e9 would keep this tiny model in CPU and skip the NVMe
    path under test)."""
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section.update(nvme_path=os.path.join(nvme_dir, "param"), buffer_count=2,
                       buffer_size=40_000, max_in_cpu=0)
    return section


def offload_optimizer(device: str, nvme_dir: str | None = None,
                      ratio: float | None = None) -> dict:
    """``offload_optimizer``; nvme: files under ``nvme_dir/optim``; ``ratio`` when given."""
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section["nvme_path"] = os.path.join(nvme_dir, "optim")
    if ratio is not None:
        section["ratio"] = ratio
    return section


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


def tiny_mlp() -> torch.nn.Module:
    """6 -> 16 -> 16 -> 3 with tanh (~450 parameters), seeded: the same weights every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def mlp_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (input, target) of ``step`` for ``tiny_mlp``: 5 samples."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def mlp_reference(world: int, steps: int, *, lr: float, clip: float
                  ) -> tuple[list[list[float]], list[torch.Tensor]]:
    """torch AdamW (weight decay 0.1) + clip_grad_norm_ on ``tiny_mlp`` over every rank's
    ``mlp_batch`` (MSE, mean over ranks): each step's per-rank losses, and the final
    parameters in ``parameters()`` order."""
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        outs = [torch.nn.functional.mse_loss(model(mlp_batch(step, r)[0]), mlp_batch(step, r)[1])
                for r in range(world)]
        (sum(outs) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append([o.item() for o in outs])
    return losses, [p.detach() for p in model.parameters()]
