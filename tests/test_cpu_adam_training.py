"""The one-pass CPU Adam (ZEROIO_CPU_ADAM=compiled) in training, against torch AdamW.

The tiny tied Llama of tests/test_stage3_equivalence.py (gradient checkpointing, 2 micro steps
per step, clipping). The cases are stage 2 with offload_optimizer cpu and stage 3 with
offload_param and offload_optimizer cpu, each fp32 with the plain step and bf16 with the
overlapped step. The kernel writes the 16-bit values in its own pass:
- stage 2 on CUDA: into pinned slots that go up to the GPU (the slots must exist);
- stage 2 on the CPU: into the parameters;
- stage 3: into the host shards.
What the model then holds must equal the masters rounded to the compute dtype
(``published_diff`` 0).

Tolerances as tests/test_stage3_gpu.py. On the CPU the fp32 runs match to 5e-5. bf16 losses
must be within 3e-2, and the mean master drift within 15 %.

16-bit host gradients (stage12.[Note: 16-bit host gradients]): bf16 at stage 2 with
gradient_accumulation_steps 1, and at stage 1, hand the kernel bf16 host gradient shards (the
1/world folded into its grad_scale), stage 2 with accumulation fp32 ones where the micro steps
are summed on the host (a CPU device) and bf16 where the placement sums them on the GPU
(``Placement.accumulation_on_device``: nothing accumulates on the host); at world 1 and 2 (so
the folding is checked), and with offload_optimizer.ratio 0.5 (device side fp32). Each case
asserts the dtype the host step's CPU Adam reads and where the gradient lives (a host shard,
or on a GPU the device home the host step streams it from: [Note: the gradient's home] in
zeroio/config/accum_place.py), so the test fails if the path is not taken.

On the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_cpu_adam_training.py
"""

from __future__ import annotations

import os

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.markers import needs_compiler
from zeroio.testing.models import llama_reference, offload_optimizer, token_batches
from zeroio.testing.training import (
    reference_diffs,
    reference_failures,
    train_llama,
)

CASES = [(2, "fp32", False), (2, "bf16", True), (3, "fp32", False), (3, "bf16", True)]
"""(stage, dtype, overlap_step)."""



def _info(engine):
    opt = getattr(engine.optimizer, "host", engine.optimizer)
    part = engine.partitioner
    return {"engine_device": str(engine.device), "one_pass": bool(opt.one_pass),
            "pinned_slots": len(getattr(part, "_stage_slots", [])),
            "assist": getattr(part, "_assist", None) is not None}


def _config(stage, dtype, overlap, tmpdir):
    cfg = eq._config("cpu" if stage == 3 else "none", "cpu", dtype, tmpdir, 0)
    zero = cfg["zero_optimization"]
    zero["stage"] = stage
    zero["tiering"] = {"overlap_step": overlap}
    if stage != 3:
        zero.pop("offload_param")
    return cfg


def _body(tmpdir, cuda):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device() if cuda else None
    init, batches, ref_losses, ref_params = eq._start(world)
    results = []
    for i, (stage, dtype, overlap) in enumerate(CASES):
        cfg = _config(stage, dtype, overlap, os.path.join(tmpdir, f"c{i}-r{rank}"))
        losses, params, masters, info = train_llama(batches, init, cfg, device=device,
                                                    inspect=_info)
        results.append(dict(case=(stage, dtype, overlap), **info,
                            **reference_diffs(losses, params, masters, ref_losses, ref_params,
                                              init, dtype)))
    return results


def _check(results, cuda):
    for rank_results in results:
        for r in rank_results:
            assert r["one_pass"], r  # the compiled kernel stepped the host masters
            stage, dtype, _ = r["case"]
            if cuda and stage == 2 and dtype == "bf16":
                # the kernel wrote the pinned bf16 slots: two, or four when the step assist is
                # on (a CPU chunk's copy may queue behind the GPU's chunks)
                assert r["pinned_slots"] == (4 if r["assist"] else 2), r
            assert not reference_failures(r, dtype, fp32_tol=5e-5), r


@needs_compiler
def test_one_pass_adam_in_training_cpu(tmp_path):
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    _check(run_ranks(_body, 1, str(tmp_path), False, env=env, timeout=600), cuda=False)


@pytest.mark.gpu
@needs_compiler
def test_one_pass_adam_in_training_one_gpu(tmp_path):
    need_cuda(1)
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    _check(run_ranks(_body, 1, str(tmp_path), True, backend="nccl", env=env, timeout=400),
           cuda=True)


GRAD_CASES = [(2, 2, None, "torch.float32"), (2, 1, None, "torch.bfloat16"),
              (1, 2, None, "torch.bfloat16"), (2, 1, 0.5, "torch.bfloat16")]
"""bf16: (stage, gradient_accumulation_steps, offload_optimizer.ratio, the
host gradient shard's dtype)."""


def _watch_shard_norm(engine):
    """Each time the step takes its gradient norm, also take it from the gradient shards as
    they stand then (the fallback path), before the optimizer runs: on CUDA torch's fused
    Adam(W) writes the unscaled, clipped gradient back into the device side's fp32 shard, so
    the shards read after the step no longer hold what the step saw."""
    part = engine.partitioner
    taken = part.local_grad_sq_norm

    def both():
        out = taken()
        parts, part._norm_parts = part._norm_parts, []
        part.shard_sq_norm_seen = taken()
        part._norm_parts = parts
        return out

    part.local_grad_sq_norm = both


def _grad_info(engine):
    import torch

    from zeroio.partition import collectives

    part, opt = engine.partitioner, engine.optimizer
    host_opt = getattr(opt, "host", opt)
    engine.synchronize()
    sq = collectives.all_reduce_scalar(part.shard_sq_norm_seen.double().to(engine.device))
    return {"shard_norm": float(torch.sqrt(sq)), "last_norm": engine.last_grad_norm,
            "one_pass": bool(host_opt.one_pass), "grad_divisor": host_opt.grad_divisor,
            "read": str(part.grad_read_dtype), "streamed": part.grads_streamed,
            "accum_dev": engine.placement.accumulation_on_device,
            "host_grads": sorted({str(g.grad.dtype) for g in part._host if g.grad.numel()}),
            "device_grads": sorted({str(g.grad.dtype) for g in part._dev if g.grad.numel()}),
            "pinned_slots": len(part._stage_slots),
            "assist": getattr(part, "_assist", None) is not None}


def _grad_body(tmpdir, cuda):
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device() if cuda else None
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    results = []
    for i, (stage, gas, ratio, _) in enumerate(GRAD_CASES):
        batches = token_batches(world, steps=eq.STEPS, gas=gas, micro=eq.MICRO)
        ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP)
        # overlapped step at world 1 only: on the CPU its worker's all-gathers would race the
        # loss all-reduce of train_steps on the main thread (gloo matches collectives by order)
        cfg = _config(stage, "bf16", world == 1, os.path.join(tmpdir, f"g{i}-r{rank}"))
        cfg["gradient_accumulation_steps"] = gas
        cfg["zero_optimization"]["offload_optimizer"] = offload_optimizer("cpu", ratio=ratio)
        losses, params, masters, info = train_llama(batches, init, cfg, device=device,
                                                    inspect=_grad_info,
                                                    on_engine=_watch_shard_norm)
        results.append(dict(case=(stage, gas, ratio), world=world, **info,
                            **reference_diffs(losses, params, masters, ref_losses, ref_params,
                                              init, "bf16")))
    return results


def _check_grads(results, cuda):
    for rank_results in results:
        for r, (stage, gas, ratio, host_dtype) in zip(rank_results, GRAD_CASES, strict=True):
            assert r["one_pass"], r
            # the placement's decision: stage 2's sum on the device reads as one micro step's
            summed_on_device = stage == 2 and gas > 1 and r["accum_dev"]
            if summed_on_device:
                host_dtype = "torch.bfloat16"
            assert r["read"] == host_dtype, r  # the path under test was taken (or not)
            assert r["host_grads"] == ["torch.float32" if summed_on_device else host_dtype], r
            # a CPU device has no room: the host path; a GPU keeps the gradient
            assert r["streamed"] == cuda and r["accum_dev"] == (cuda and stage == 2 and gas > 1)
            assert r["device_grads"] == ([] if ratio is None else ["torch.float32"]), r
            low = host_dtype != "torch.float32"
            assert r["grad_divisor"] == (float(r["world"]) if low else 1.0), r
            # the last step's norm again, from the (16-bit, unaveraged) host shards as the
            # step saw them
            assert abs(r["shard_norm"] - r["last_norm"]) <= 1e-3 * r["last_norm"], r
            if cuda:  # two pinned bf16 slots, four with the step assist (as _check)
                assert r["pinned_slots"] == (4 if r["assist"] else 2), r
            assert not reference_failures(r, "bf16", fp32_tol=5e-5), r


@needs_compiler
@pytest.mark.parametrize("world", [1, 2])
def test_16bit_host_grads_in_training_cpu(tmp_path, world):
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    _check_grads(run_ranks(_grad_body, world, str(tmp_path), False, env=env, timeout=600),
                 cuda=False)


def test_torch_kernel_keeps_fp32_host_grads(tmp_path, monkeypatch):
    """The default (torch's fused kernel): fp32 host gradients at stage 2 gas 1 bf16."""
    import torch

    import zeroio

    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")
    cfg = _config(2, "bf16", False, str(tmp_path))
    cfg["gradient_accumulation_steps"] = 1
    model = eq.tiny_llama()
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    try:
        assert engine.partitioner.host_grad_dtype == torch.float32
        assert {g.grad.dtype for g in engine.partitioner.groups} == {torch.float32}
        assert engine.optimizer.grad_divisor == 1.0 and not engine.optimizer.one_pass
    finally:
        engine.close()


@pytest.mark.gpu
@needs_compiler
@pytest.mark.parametrize("world", [1, 2])
def test_16bit_host_grads_in_training_gpu(tmp_path, world):
    need_cuda(world)
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    _check_grads(run_ranks(_grad_body, world, str(tmp_path), True, backend="nccl", env=env,
                           timeout=400), cuda=True)
