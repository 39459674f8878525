"""Stage 3 x offload_param none/cpu/nvme x offload_optimizer none/cpu/nvme x fp32/bf16
on 1, 2 and 3 gloo ranks against single-process torch.optim.AdamW, with a tiny
Hugging Face Llama (tied embeddings, gradient checkpointing).

One ``run_ranks`` per world size; the rank body loops over its configurations.
World 2 covers every offload pair in both precisions; worlds 1 and 3 a subset.

Tolerances (as in test_stage12_equivalence):
- fp32: the same math as the reference in another summation order (gradients
  summed over ranks then micro steps, norm in float64), a few ulps per step;
  Adam normalises the update, so after STEPS steps at lr 1e-3 differences stay
  ~1e-6: we allow 2e-5 relative on the loss and 2e-5 absolute on parameters.
- bf16: compute in bf16 (~4e-3 relative per rounding) vs an fp32 reference:
  losses within 3e-2 relative; fp32 masters within 15% (mean |difference|) of
  the mean distance the reference moved them.
Every case also checks that the parameters seen through
``GatheredParameters`` equal the fp32 masters rounded to the compute dtype,
i.e. that what stage 3 gathers is exactly what the optimizer published.
"""

from __future__ import annotations

import os

from zeroio.testing import run_ranks
from zeroio.testing.models import (
    SMALL_STAGE3,
    llama_reference,
    offload_optimizer,
    offload_param,
    stage3_config,
    tiny_llama,
    token_batches,
)
from zeroio.testing.training import reference_diffs, reference_failures, train_llama

STEPS, GAS, MICRO, LR, CLIP = 6, 2, 2, 1e-3, 0.05
OFFLOADS = ("none", "cpu", "nvme")


def _batches(world):
    return token_batches(world, steps=STEPS, gas=GAS, micro=MICRO)


def _reference(batches, init_state):
    return llama_reference(batches, init_state, lr=LR, clip=CLIP)


def _start(world):
    """Seeded initial weights, this world's batches and the reference run on them:
    ``(init, batches, ref_losses, ref_params)``."""
    import torch

    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    batches = _batches(world)
    return (init, batches, *_reference(batches, init))


def _config(off_param, off_opt, dtype, nvme_dir, persistence):
    return stage3_config(micro=MICRO, gas=GAS, clip=CLIP, lr=LR, zero=dict(
        SMALL_STAGE3, stage3_param_persistence_threshold=persistence,
        offload_param=offload_param(off_param, nvme_dir),
        offload_optimizer=offload_optimizer(off_opt, nvme_dir)), bf16={"enabled": dtype == "bf16"})


def _nvme_ready():
    """NVMe offload needs the tiered store's NVMe backend and the swapped optimizer."""
    try:
        import zeroio.optim.swap  # noqa: F401
        import zeroio.tiering.nvme  # noqa: F401
        return True
    except ImportError:
        return False


def _cases(world):
    cases = _all_cases(world)
    return cases if _nvme_ready() else [c for c in cases if "nvme" not in c[:2]]


def _all_cases(world):
    if world == 2:
        return [(p, o, d, 0) for p in OFFLOADS for o in OFFLOADS for d in ("fp32", "bf16")] + [
            ("cpu", "none", "fp32", 100)]  # norms (32 elements) persistent
    if world == 1:
        return [("none", "none", "fp32", 0), ("cpu", "cpu", "bf16", 0), ("nvme", "nvme", "fp32", 0)]
    return [("none", "cpu", "fp32", 0), ("nvme", "none", "bf16", 0), ("cpu", "nvme", "fp32", 100)]


def _body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    init, batches, ref_losses, ref_params = _start(world)
    results = []
    for i, (off_param, off_opt, dtype, persistence) in enumerate(_cases(world)):
        nvme_dir = os.path.join(tmpdir, f"case{i}-r{rank}")
        cfg = _config(off_param, off_opt, dtype, nvme_dir, persistence)
        losses, params, masters, _ = train_llama(batches, init, cfg)
        results.append(dict(case=(off_param, off_opt, dtype, persistence), **reference_diffs(
            losses, params, masters, ref_losses, ref_params, init, dtype)))
    return results


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert not reference_failures(r, r["case"][2], fp32_tol=2e-5), r
def test_world_2_every_offload_pair(tmp_path):
    _check(run_ranks(_body, 2, str(tmp_path), timeout=300))


def test_world_1(tmp_path):
    _check(run_ranks(_body, 1, str(tmp_path), timeout=200))


def test_world_3(tmp_path):
    _check(run_ranks(_body, 3, str(tmp_path), timeout=200))
