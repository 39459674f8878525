"""The bounded staging of later host-gradient writes (partition/landing.py, [Note: bounded
staging]): a few slots, a worker thread, sums bit-equal to adding in order on the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from zeroio.partition.landing import StagedAdds
from zeroio.shard.host_rule import STAGING_SLOTS


def _pieces(gen, n_dst: int, writes: int, numel: int):
    """``writes`` rounds of one random piece per destination, fp32 with a wide exponent range
    (so the order of the adds shows in the low bits)."""
    return [[(torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 6, (numel,),
                                                                          generator=gen))
             for _ in range(n_dst)] for _ in range(writes)]


@pytest.mark.parametrize("slots", [1, 2, STAGING_SLOTS])
def test_sums_equal_in_order_adds_and_slots_stay_bounded(slots):
    gen = torch.Generator().manual_seed(0)
    numel, n_dst = 1000, 4
    rounds = _pieces(gen, n_dst, writes=6, numel=numel)
    dst = [torch.zeros(numel) for _ in range(n_dst)]
    want = [torch.zeros(numel) for _ in range(n_dst)]
    adds = StagedAdds(numel, pin=False, slots=slots)
    for parts in rounds:
        for d, (g, w) in enumerate(zip(parts, want, strict=True)):
            # two halves of one destination in one slot, as a group's landings are
            adds.stage([(g[:400], dst[d][:400]), (g[400:], dst[d][400:])], None)
            w.add_(g)
            g.fill_(float("nan"))  # the slot holds its own copy: the source may be reused
            assert len(adds.held_tensors()) <= slots
    adds.drain()
    for got, w in zip(dst, want, strict=True):
        assert torch.equal(got, w)
    assert len(adds.held_tensors()) == slots
    adds.close()


def test_reserve_allocates_every_slot_once_and_close_stops_the_worker():
    adds = StagedAdds(64, pin=False)
    adds.reserve()
    held = [t.data_ptr() for t in adds.held_tensors()]
    assert len(held) == STAGING_SLOTS and all(t.numel() == 64 for t in adds.held_tensors())
    dst = torch.zeros(64)
    for _ in range(10):
        adds.stage([(torch.ones(64), dst)], None)
    adds.close()
    assert torch.equal(dst, torch.full((64,), 10.0))
    assert [t.data_ptr() for t in adds.held_tensors()] == held
    assert not [t for t in threading.enumerate() if t.name.startswith("zeroio-staged-add")]


def test_oversized_piece_and_failed_add_are_reported():
    adds = StagedAdds(8, pin=False)
    with pytest.raises(ValueError, match="exceed the slot's 8"):
        adds.stage([(torch.ones(9), torch.zeros(9))], None)
    adds.stage([(torch.ones(4), torch.zeros(5))], None)  # a destination of the wrong length
    with pytest.raises(RuntimeError):
        adds.drain()
    adds.close()
    with pytest.raises(ValueError, match="slots >= 1"):
        StagedAdds(8, pin=False, slots=0)
