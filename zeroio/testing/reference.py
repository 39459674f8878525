"""The independent reference every equivalence test compares against: plain
single-process PyTorch AdamW with gradient accumulation and global-norm clipping.

Kept free of zeroio imports on purpose, so it cannot share a bug with the code
under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def adamw_reference(
    model: torch.nn.Module,
    steps: Iterable[Sequence[Any]],
    loss_of: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    clip: float,
    param_groups: Iterable[Any] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` in place: each step is a sequence of micro-batches (each already the
    global micro-batch over all ranks); the step's loss is the mean of ``loss_of(model,
    micro)``. ``param_groups`` (AdamW's groups over ``model``'s parameters) replace the one
    group of every parameter. Returns the per-step losses and the final parameters by name."""
    params = model.parameters() if param_groups is None else param_groups
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for step in steps:
        total = 0.0
        for micro in step:
            loss = loss_of(model, micro)
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
