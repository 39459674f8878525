"""offload_optimizer.ratio on CUDA: stage 3 twin placement vs single-process torch AdamW.

The tiny tied Llama of tests/test_stage3_equivalence.py (gradient checkpointing, 2 micro
steps per step, clipping), stage 3 with offload_param cpu and offload_optimizer cpu at ratio
0.5: half of each rank's optimizer elements are stepped by the fused Adam on the GPU, half by
the CPU Adam, and the device side is published into the pinned host shards on the d2h stream
without a host wait ([Note: asynchronous device-side publish] in
zeroio/partition/stage3/twin.py). Cases: fp32 with the plain step, fp32 with the overlapped
step and a ~50 ms spin on the d2h stream before every publish (a gather that did not wait for
its group's copies would read the old shard and the masters would drift from the reference),
and bf16 with the overlapped step. On 1 GPU and on 2 GPUs (NCCL).

Tolerances as tests/test_stage3_gpu.py: fp32 losses within 5e-5 relative and masters within
5e-5 (TF32 off); bf16 losses within 3e-2, mean master drift within 15 %; what
``GatheredParameters`` sees equals the masters cast to the compute dtype exactly.

Run on the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_ratio_gpu.py
"""

from __future__ import annotations

import os

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.training import reference_diffs, reference_failures, train_llama

pytestmark = pytest.mark.gpu

RATIO = 0.5
CASES = [("fp32", False, False), ("fp32", True, True), ("bf16", True, False)]
"""(dtype, overlap_step, spin the d2h stream before each device-side publish)."""


def _slow_publish() -> None:
    """~50 ms of GPU cycles on the publish stream before its copies (see the docstring)."""
    import torch

    from zeroio.partition.stage3.twin import DevicePublish

    real = DevicePublish.publish
    if getattr(real, "slowed", False):
        return

    def publish(self, gi, host_shard, pieces, after):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(50_000_000)
        return real(self, gi, host_shard, pieces, after)

    publish.slowed = True
    DevicePublish.publish = publish


def _twin_info(engine):
    from zeroio.partition.stage3.twin import Side

    part = engine.partitioner
    publisher = part._publisher
    return {"engine_device": str(engine.device), "async_publish": publisher is not None,
            "staging_bytes": publisher.staging_bytes if publisher is not None else 0,
            "device_elements": part.optimizer_split.numel(Side.DEVICE)}


def _body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device()
    init, batches, ref_losses, ref_params = eq._start(world)
    results = []
    for i, (dtype, overlap, slow) in enumerate(CASES):
        if slow:
            _slow_publish()
        cfg = eq._config("cpu", "cpu", dtype, os.path.join(tmpdir, f"c{i}-r{rank}"), 0)
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = RATIO
        cfg["zero_optimization"]["tiering"] = {"overlap_step": overlap}
        losses, params, masters, info = train_llama(batches, init, cfg, device=device,
                                                    inspect=_twin_info)
        results.append(dict(
            case=(dtype, overlap, slow), device=str(device), **info,
            **reference_diffs(losses, params, masters, ref_losses, ref_params, init, dtype)))
    return results


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert r["engine_device"] == r["device"], r
            assert r["async_publish"] and r["staging_bytes"] > 0, r  # the CUDA path ran
            assert r["device_elements"] > 0, r
            assert not reference_failures(r, r["case"][0], fp32_tol=5e-5), r
def test_ratio_one_gpu(tmp_path):
    need_cuda(1)
    _check(run_ranks(_body, 1, str(tmp_path), backend="nccl", timeout=200))


def test_ratio_two_gpus_nccl(tmp_path):
    need_cuda(2)
    _check(run_ranks(_body, 2, str(tmp_path), backend="nccl", timeout=200))
