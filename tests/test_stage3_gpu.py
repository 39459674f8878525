"""Stage 3 on CUDA: equivalence with single-process torch AdamW on 1 GPU and on 2 GPUs (NCCL).

The same tiny tied Llama with gradient checkpointing as tests/test_stage3_equivalence.py,
offload_param none / cpu / nvme (NVMe with buffers of one shard), in fp32 and bf16; the
reference runs on the CPU. With ``delay`` every all-gather and reduce-scatter is preceded
by a ~50 ms spin on the stream it is issued from (the comm stream of [Note: stage-3
streams]), as FSDP's tests do: a missing event wait between the comm and compute streams
then shows up as wrong parameters or gradients.

Tolerances: bf16 as on CPU. fp32: CUDA kernels sum in another order than the CPU
reference (TF32 is switched off), so losses within 5e-5 relative and masters within 5e-5.

Run on the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_stage3_gpu.py
"""

from __future__ import annotations

import os

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.training import reference_diffs, reference_failures, train_llama

pytestmark = pytest.mark.gpu

CASES = [("none", "none", "fp32", False), ("cpu", "none", "fp32", False),
         ("nvme", "none", "fp32", False), ("none", "cpu", "bf16", False),
         ("cpu", "nvme", "bf16", False), ("nvme", "cpu", "bf16", False),
         ("nvme", "none", "fp32", True), ("none", "none", "bf16", True)]


def _delay_collectives() -> None:
    """Spin the issuing stream before each stage-3 collective (see the module docstring)."""
    import torch

    from zeroio.partition import collectives as comm
    from zeroio.partition.stage3 import group

    def slow(fn):
        def wrapped(t, pg=None):
            torch.cuda._sleep(50_000_000)  # ~50 ms of GPU cycles on the current (comm) stream
            return fn(t, pg)
        return wrapped

    group.comm = type("SlowComm", (), {
        "all_gather_inplace": staticmethod(slow(comm.all_gather_inplace)),
        "reduce_scatter_inplace": staticmethod(slow(comm.reduce_scatter_inplace)),
        "CommHandle": comm.CommHandle})


def _store_stats(device):
    def inspect(engine):
        if engine.device != device:
            raise AssertionError(f"engine runs on {engine.device}, expected {device}")
        store = engine.partitioner.store
        return store.stats() if hasattr(store, "stats") else {}
    return inspect


def _body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device()
    init, batches, ref_losses, ref_params = eq._start(world)
    results = []
    for i, (off_param, off_opt, dtype, delay) in enumerate(CASES):
        if delay:
            _delay_collectives()
        cfg = eq._config(off_param, off_opt, dtype, os.path.join(tmpdir, f"c{i}-r{rank}"), 0)
        if off_param == "nvme":  # buffers of one layer shard, as in test_stage3_offload
            size = (5200 if dtype == "fp32" else 3100) * (2 if world == 1 else 1)
            cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=size)
        losses, params, masters, stats = train_llama(batches, init, cfg, device=device,
                                                     inspect=_store_stats(device))
        results.append(dict(
            case=(off_param, off_opt, dtype, delay),
            **reference_diffs(losses, params, masters, ref_losses, ref_params, init, dtype),
            nvme_read=stats.get("bytes_moved", {}).get("nvme->cpu", 0)))
    return results


def _check(results):
    for rank_results in results:
        for r in rank_results:
            if r["case"][0] == "nvme":
                assert r["nvme_read"] > 0, r
            assert not reference_failures(r, r["case"][2], fp32_tol=5e-5), r
def test_stage3_one_gpu(tmp_path):
    need_cuda(1)
    _check(run_ranks(_body, 1, str(tmp_path), backend="nccl", timeout=500))


def test_stage3_two_gpus_nccl(tmp_path):
    need_cuda(2)
    _check(run_ranks(_body, 2, str(tmp_path), backend="nccl", timeout=500))
