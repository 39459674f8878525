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

On the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_cpu_adam_training.py
"""

from __future__ import annotations

import os
import shutil

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.training import reference_diffs, reference_failures, train_llama

CASES = [(2, "fp32", False), (2, "bf16", True), (3, "fp32", False), (3, "bf16", True)]
"""(stage, dtype, overlap_step)."""

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch inductor's CPU backend needs a C++ compiler")


def _info(engine):
    opt = getattr(engine.optimizer, "host", engine.optimizer)
    part = engine.partitioner
    return {"engine_device": str(engine.device), "one_pass": bool(opt.one_pass),
            "pinned_slots": len(getattr(part, "_stage_slots", []))}


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
                assert r["pinned_slots"] == 2, r  # the kernel wrote the pinned bf16 slots
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
