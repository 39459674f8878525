"""NVMe sub-group pipeline: same numbers as the in-memory sharded Adam, moments really swapped."""

import pytest
import torch

import zeroio
from zeroio.optim.adam import ShardedAdam
from zeroio.optim.swap import SwappedAdam
from zeroio.optim.swap_plan import split
from zeroio.partition.base import Segment, ShardGroup
from zeroio.tiering import MemoryBackend


def _groups(seed):
    torch.manual_seed(seed)
    return [ShardGroup(group_index=i, master=torch.randn(n), grad=torch.zeros(n), numel=n,
                       segments=(Segment(local_offset=0, global_offset=off, numel=n),))
            for i, (n, off) in enumerate(((37, 0), (11, 37)))]


HYPER = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1},
         {"lr": 3e-3, "betas": (0.8, 0.999), "eps": 1e-6, "weight_decay": 0.0}]


@pytest.mark.parametrize("read,write", [(True, True), (False, False), (True, False)])
def test_swapped_matches_in_memory(read, write, tmp_path):
    cfg = zeroio.load_config({
        "train_batch_size": 1,
        "zero_optimization": {"stage": 2, "sub_group_size": 8, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": read,
            "pipeline_write": write, "buffer_count": 2}}})
    a, b = _groups(0), _groups(0)
    swapped = SwappedAdam(a, HYPER, decoupled=True, cfg=cfg, backend=MemoryBackend())
    plain = ShardedAdam(b, HYPER, decoupled=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for x, y in zip(a, b, strict=True):
            grad = torch.randn(x.grad.numel(), generator=g)
            x.grad.copy_(grad)
            y.grad.copy_(grad)
        swapped.step(grad_scale=2.0)
        plain.step(grad_scale=2.0)
    for i in range(2):
        # fused kernels on a sub-slice vs the whole tensor may round the tail differently
        torch.testing.assert_close(a[i].master, b[i].master, rtol=1e-6, atol=1e-6)
        for kind in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(swapped.local_tensor(i, kind), plain.local_tensor(i, kind),
                                       rtol=1e-6, atol=1e-9)
        assert swapped.steps_taken(i) == 6
    stats = swapped.store.stats()
    # 2 buffers of 8 floats cannot hold 6 sub-groups x 2 moments: they went to "NVMe" and back
    assert stats["bytes_moved"]["cpu->nvme"] > 0 and stats["bytes_moved"]["nvme->cpu"] > 0
    swapped.close()


def test_split_covers_each_group_once():
    subs = split(_groups(0), 8)
    assert [(s.group_index, s.start, s.numel) for s in subs] == (
        [(0, o, 8) for o in range(0, 32, 8)] + [(0, 32, 5), (1, 0, 8), (1, 8, 3)])


def test_nvme_without_path_is_config_error():
    with pytest.raises(zeroio.ConfigError, match="nvme_path") as info:
        zeroio.load_config({"train_batch_size": 1, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme"}}})
    assert "nvme_path" in info.value.key
