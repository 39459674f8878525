"""Inside a rank of ``run_ranks``: train a zeroio engine on ``token_batches`` and read back what
an equivalence test compares with ``llama_reference``: the per-step losses, the fp32 masters
(or moments) over all ranks, and the parameters ``GatheredParameters`` publishes.

Every read goes through the engine's public surface (``engine.optimizer.local_tensor``, the
partitioner's index and segments, ``zeroio.zero.GatheredParameters``), not through the
reference, so a bug in one cannot hide in the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroio.partition import collectives
from zeroio.testing.models import tiny_llama


def train_steps(engine: Any, batches: list[list[torch.Tensor]], *,
                device: torch.device | None = None,
                after_step: Callable[[], None] | None = None) -> list[float]:
    """One ``engine.step()`` per micro step on this rank's rows; returns each optimizer step's
    loss as the reference computes it (mean over micro steps and ranks, summed in float64).
    ``after_step`` runs after each optimizer step's last micro step."""
    device = device or torch.device("cpu")
    rank, world = collectives.rank(), collectives.world_size()
    losses = []
    for step in batches:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for ids in step:
            x = ids[rank].to(device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()  # exact: any float32/bf16 value is a float64
        collectives.all_reduce_scalar(total)
        losses.append(total.item() / (len(step) * world))
        if after_step is not None:
            after_step()
    return losses


def rank_mean(value: float) -> float:
    """``value`` averaged over the ranks of the world, in float64 (a loss as every rank logs
    it); the value itself in a world of one."""
    total = collectives.all_reduce_scalar(torch.tensor([value], dtype=torch.float64))
    return total.item() / collectives.world_size()


def gather_state(engine: Any, kind: str = "fp32", *,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The global flat ``kind`` array of a stage-3 engine (every rank's segments summed over
    the ranks, in float64 on ``device``) by parameter name, as float32 CPU tensors."""
    device = device or torch.device("cpu")
    engine.synchronize()  # an overlapped step (tiering.overlap_step) may still write them
    part = engine.partitioner
    flat = torch.zeros(part.index.total_numel, dtype=torch.float64, device=device)
    for g in part.groups:
        local = engine.optimizer.local_tensor(g.group_index, kind).to(device)
        for s in g.segments:
            flat[s.global_offset:s.global_offset + s.numel] = \
                local[s.local_offset:s.local_offset + s.numel].double()
    collectives.all_reduce_scalar(flat)
    flat = flat.cpu()
    return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape).float()
            for e in part.index.entries}


def gathered_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter as ``GatheredParameters`` shows it, as float32 CPU copies."""
    import zeroio

    params = dict(engine.module.named_parameters())
    with zeroio.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().float().cpu().clone() for n, p in params.items()}


def shard_grad_norm(engine: Any) -> float:
    """The global gradient norm from the gradient shards as they stand: the partitioner's
    fallback path (``local_grad_sq_norm`` with no norm taken while gradients landed; the
    caller invalidates that first), summed over ranks on the engine's device (NCCL reduces
    CUDA tensors only)."""
    engine.synchronize()
    sq = engine.partitioner.local_grad_sq_norm().double().to(engine.device)
    collectives.all_reduce_scalar(sq)
    return sq.sqrt().item()


def train_llama(batches: list[list[torch.Tensor]], init: dict[str, torch.Tensor], cfg: dict, *,
                device: torch.device | None = None, layers: int = 2,
                inspect: Callable[[Any], Any] | None = None,
                on_engine: Callable[[Any], None] | None = None):
    """``tiny_llama(layers=layers)`` loaded with ``init``, trained by a zeroio engine built
    from ``cfg``; returns ``(losses, published params, fp32 masters, inspect(engine))``, the
    last read just before the engine closes (None without ``inspect``). ``on_engine`` runs
    on the new engine before the first step (e.g. to watch what the step reads)."""
    import zeroio

    model = tiny_llama(layers=layers)
    model.load_state_dict(init)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    if on_engine is not None:
        on_engine(engine)
    losses = train_steps(engine, batches, device=device)
    full = gathered_params(engine)
    masters = gather_state(engine, device=device)
    extra = inspect(engine) if inspect is not None else None
    engine.close()
    return losses, full, masters, extra


def reference_diffs(losses: list[float], published: dict[str, torch.Tensor],
                    masters: dict[str, torch.Tensor], ref_losses: list[float],
                    ref_params: dict[str, torch.Tensor], init: dict[str, torch.Tensor],
                    dtype: str) -> dict[str, float]:
    """How far a run is from the reference: ``loss_rel`` (largest relative loss difference),
    ``max_diff`` (largest master difference), ``rel_mean_diff`` (summed |master difference|
    over the distance the reference moved the parameters), and ``published_diff`` (published
    params vs the masters rounded to the compute ``dtype``, "fp32" or "bf16": 0 when stage 3
    gathers exactly what the optimizer published)."""
    cdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    moved = sum((ref_params[n] - init[n]).abs().sum().item() for n in ref_params)
    return dict(
        loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        max_diff=max((masters[n] - ref_params[n]).abs().max().item() for n in ref_params),
        rel_mean_diff=sum((masters[n] - ref_params[n]).abs().sum().item()
                          for n in ref_params) / moved,
        published_diff=max((published[n] - masters[n].to(cdtype).float()).abs().max().item()
                           for n in ref_params))


BF16_LOSS_REL = 3e-2
"""bf16 compute vs the fp32 reference: ~4e-3 relative per rounding, over a few steps."""
BF16_REL_MEAN_DIFF = 0.15
"""bf16: mean |master difference| within 15 % of the distance the reference moved them."""


def reference_failures(r: dict, dtype: str, *, fp32_tol: float) -> list[str]:
    """The equivalence checks the ``reference_diffs`` in ``r`` fail (empty: all hold):
    published == masters in the compute dtype exactly; fp32 loss (relative) and masters
    (absolute) within ``fp32_tol``; bf16 as the constants above. Tests assert it is empty."""
    checks = [("published_diff == 0", r["published_diff"] == 0.0)]
    if dtype == "fp32":
        checks += [(f"loss_rel < {fp32_tol}", r["loss_rel"] < fp32_tol),
                   (f"max_diff < {fp32_tol}", r["max_diff"] < fp32_tol)]
    else:
        checks += [(f"loss_rel < {BF16_LOSS_REL}", r["loss_rel"] < BF16_LOSS_REL),
                   (f"rel_mean_diff < {BF16_REL_MEAN_DIFF}",
                    r["rel_mean_diff"] < BF16_REL_MEAN_DIFF)]
    return [what for what, ok in checks if not ok]
