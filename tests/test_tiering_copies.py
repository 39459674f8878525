"""Copy handles (zeroio.tiering.copies): each makes the copy it names, with the values of a
plain ``copy_``, and counts the bytes that cross under their tier pair: the source's raw
``numel * element_size``, whatever dtype the destination casts to.

Without a GPU, a crossing copy is made into the ``meta`` device (a device that is not the
host: counted as "cpu->gpu", no data); the values of both directions and the stream are
checked on CUDA only."""

from __future__ import annotations

import pytest
import torch

from zeroio.testing.cuda import need_cuda
from zeroio.tiering.copies import Copies
from zeroio.tiering.stats import TierStats

DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def _moved(stats: TierStats) -> dict[str, int]:
    return stats.as_dict()["bytes_moved"]


def _src(dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    return torch.linspace(-3.0, 3.0, n, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES)
def test_a_host_copy_is_made_and_not_counted(src_dtype, dst_dtype):
    stats = TierStats()
    src = _src(src_dtype)
    dst = torch.empty(src.shape, dtype=dst_dtype)
    assert Copies(stats).into(dst, src) is dst
    assert torch.equal(dst, src.to(dst_dtype))  # the cast of a plain copy_
    new = Copies(stats).new(src, torch.device("cpu"), dtype=dst_dtype)
    assert torch.equal(new, src.to(dst_dtype)) and new.dtype == dst_dtype
    assert _moved(stats) == {}


@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES)
def test_a_crossing_copy_counts_the_source_bytes(src_dtype, dst_dtype):
    stats = TierStats()
    src = _src(src_dtype, 777)
    dst = torch.empty(src.shape, dtype=dst_dtype, device="meta")
    Copies(stats).into(dst, src, non_blocking=True)
    Copies(stats).to_device(dst, src)
    out = Copies(stats).new(src, torch.device("meta"), dtype=dst_dtype)
    assert out.device.type == "meta" and out.dtype == dst_dtype and out.shape == src.shape
    raw = src.untyped_storage().nbytes()  # the bytes of the source's memory
    assert _moved(stats) == {"cpu->gpu": 3 * raw}
    assert stats.as_dict()["step"]["bytes_moved"] == {"cpu->gpu": 3 * raw}


def test_many_copies_each_pair_and_counts_each_crossing():
    stats = TierStats()
    srcs = [_src(torch.float32, 10), _src(torch.bfloat16, 30), _src(torch.float32, 5)]
    dsts = [torch.empty(10), torch.empty(30, dtype=torch.bfloat16, device="meta"),
            torch.empty(5, dtype=torch.float16, device="meta")]
    Copies(stats).many(dsts, srcs)
    assert torch.equal(dsts[0], srcs[0])
    assert _moved(stats) == {"cpu->gpu": 30 * 2 + 5 * 4}  # the host-to-host pair is not counted
    with pytest.raises(ValueError, match="2 sources for 3 destinations"):
        Copies(stats).many(dsts, srcs[:2])


def test_no_stats_copies_without_counting():
    src = _src(torch.float32, 8)
    dst = torch.empty(8, dtype=torch.float64)
    Copies(None).into(dst, src)
    Copies(None).into(torch.empty(8, device="meta"), src)
    assert torch.equal(dst, src.double())


def test_the_direction_methods_refuse_the_other_direction():
    src, dev = _src(torch.float32, 4), torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="cpu->gpu copy got a source on meta"):
        Copies(None).to_device(dev, dev.clone())
    with pytest.raises(ValueError, match="gpu->cpu copy got a source on cpu"):
        Copies(None).to_host(src.clone(), src)


def test_to_and_host_are_tensor_to_and_cpu_counted():
    """``Copies.to`` / ``Copies.host`` return what ``Tensor.to`` / ``Tensor.cpu`` return (the
    tensor itself when nothing changes) and count the source's bytes when they cross."""
    stats = TierStats()
    src = _src(torch.float32, 50)
    assert Copies(stats).host(src) is src  # as src.cpu(): no copy, nothing crossed
    assert Copies(stats).to(src, "cpu") is src
    same = Copies(stats).to(src, torch.device("cpu"), copy=True)
    assert same is not src and torch.equal(same, src)
    cast = Copies(stats).to(src, "cpu", dtype=torch.bfloat16)
    assert torch.equal(cast, src.to(torch.bfloat16))
    assert _moved(stats) == {}
    up = Copies(stats).to(src, torch.device("meta"), dtype=torch.bfloat16)
    assert up.device.type == "meta" and up.dtype == torch.bfloat16 and up.shape == src.shape
    Copies(stats).to(torch.zeros((), dtype=torch.float64), "meta")  # a scalar: its 8 bytes
    assert _moved(stats) == {"cpu->gpu": 50 * 4 + 8}
    Copies(None).to(src, "meta")  # no stats: moved, counted nowhere


def test_a_device_shard_put_from_the_host_counts_its_bytes():
    """Stage 3's device store takes a host shard through the partitioner's handle: the bytes
    that cross are counted (a host store's put is host to host: nothing)."""
    from zeroio.partition.stage3.store import DeviceShards, HostShards

    stats = TierStats()
    shard = _src(torch.bfloat16, 96)
    DeviceShards(torch.device("meta"), transfers=stats).put(0, shard)
    assert _moved(stats) == {"cpu->gpu": 96 * 2}
    host = HostShards(torch.device("cpu"), pin=False, transfers=stats)
    host.put(1, shard)
    assert torch.equal(host.fetch(1, None).tensor, shard)
    assert _moved(stats) == {"cpu->gpu": 96 * 2}


def test_the_shards_norm_reads_one_counted_scalar_per_shard():
    """``shards_sq_norm``: the fp32 norms squared in float64, summed on the host, as a hand
    computation; with ``divisor`` (unaveraged host gradients) every norm divided by it first,
    whatever the shard's dtype (an fp32 sum of unaveraged values too)."""
    from zeroio.partition.grad_norm import shards_overflow, shards_sq_norm

    stats = TierStats()
    a, b = _src(torch.float32, 40), _src(torch.bfloat16, 30)
    got = shards_sq_norm([a, torch.empty(0), b], Copies(stats), divisor=4.0)
    want = ((a.double().norm() / 4.0) ** 2 + (b.double().norm() / 4.0) ** 2).float()
    assert torch.allclose(shards_sq_norm([a], Copies(stats)),
                          (a.double().norm() ** 2).float(), rtol=1e-6)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-6)
    assert _moved(stats) == {}  # host shards: nothing crosses
    assert not shards_overflow([a, b], Copies(stats))
    bad = b.clone()
    bad[7] = float("inf")
    assert shards_overflow([a, bad], Copies(stats))
    assert shards_overflow([torch.tensor([float("nan")])], Copies(stats))
    assert _moved(stats) == {}


# ---- on a GPU: both directions, their values, pinned non-blocking copies, a named stream ---

@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES)
def test_cuda_both_directions(src_dtype, dst_dtype):
    need_cuda(1)
    dev = torch.device("cuda", torch.cuda.current_device())
    stats = TierStats()
    host = _src(src_dtype).pin_memory()
    up = Copies(stats).new(host, dev, dtype=dst_dtype, non_blocking=True)
    back = torch.empty(host.shape, dtype=src_dtype).pin_memory()
    Copies(stats).to_host(back, up, non_blocking=True)
    torch.cuda.synchronize(dev)
    assert torch.equal(up.cpu(), host.to(dst_dtype))
    assert torch.equal(back, host.to(dst_dtype).to(src_dtype))
    n = host.numel()
    assert _moved(stats) == {"cpu->gpu": n * host.element_size(),
                             "gpu->cpu": n * up.element_size()}


def test_cuda_a_handle_issues_on_its_stream():
    need_cuda(1)
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(dev)
    stats = TierStats()
    host = _src(torch.float32, 1 << 20).pin_memory()
    dst = torch.zeros(host.shape, device=dev)
    out = torch.zeros(3, device=dev)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(1 << 30)  # the current stream is busy for a while
    copies = Copies(stats, stream)
    copies.into(dst, host, non_blocking=True)
    copies.many([out], [host[:3]], non_blocking=True)
    stream.synchronize()  # the copies were on ``stream``: done, while the sleep still runs
    assert not torch.cuda.current_stream(dev).query()
    with torch.cuda.stream(stream):
        got, got3 = dst.to("cpu"), out.to("cpu")
    assert torch.equal(got, host) and torch.equal(got3, host[:3])
    assert _moved(stats) == {"cpu->gpu": (host.numel() + 3) * 4}
    torch.cuda.synchronize(dev)
