"""The machinery stages 1/2 and 3 share, against hand computations: the host step's chunk plan
(partition/host_plan.py), the ratio split (partition/split.py) and the gradient landing
(partition/landing.py)."""

from __future__ import annotations

import pytest
import torch

from zeroio.partition.flat import Bucket, ParamSlot
from zeroio.partition.host_plan import chunk_bounds, chunk_holding
from zeroio.partition.landing import land, plan_pieces
from zeroio.partition.split import Side, device_numel, split_range
from zeroio.tiering.stats import TierStats


def test_chunk_bounds_are_equal_parts_without_a_tail():
    # 10 elements, chunks of at most 4: ceil(10/4) = 3 parts at 10*j//3 = 0, 3, 6
    assert chunk_bounds(0, 10, 4) == [(0, 3), (3, 6), (6, 10)]
    # an offset run: [5, 13) is 8 elements, 2 parts of 4
    assert chunk_bounds(5, 13, 4) == [(5, 9), (9, 13)]
    assert chunk_bounds(0, 4, 4) == [(0, 4)]
    assert chunk_bounds(0, 9, 1) == [(i, i + 1) for i in range(9)]
    assert chunk_bounds(3, 3, 4) == [] and chunk_bounds(4, 3, 4) == []
    with pytest.raises(ValueError, match="chunk"):
        chunk_bounds(0, 4, 0)


def test_chunk_holding_finds_the_part_of_an_element():
    bounds = chunk_bounds(2, 12, 4)  # 10 elements -> (2, 5), (5, 8), (8, 12)
    assert bounds == [(2, 5), (5, 8), (8, 12)]
    assert [chunk_holding(bounds, e) for e in range(2, 12)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    for outside in (1, 12):
        with pytest.raises(ValueError, match="outside"):
            chunk_holding(bounds, outside)


def test_ratio_split_of_a_local_range():
    assert device_numel(10, 0.75) == 2  # floor(10 * 0.25)
    assert device_numel(10, 1.0) == 0 and device_numel(3, 0.01) == 2
    # cut at 4: [2, 7) is device 2..3 then host 0..2 (host starts count from the cut)
    assert split_range(2, 5, 4) == [(0, Side.DEVICE, 2, 2), (2, Side.HOST, 0, 3)]
    assert split_range(0, 3, 4) == [(0, Side.DEVICE, 0, 3)]
    assert split_range(5, 3, 4) == [(0, Side.HOST, 1, 3)]
    assert split_range(0, 4, 0) == [(0, Side.HOST, 0, 4)]  # ratio 1: everything host


def test_land_copies_first_adds_later_and_asks_to_stage_across_devices():
    stats = TierStats()
    src = torch.tensor([1.0, 2.0, 3.0])
    dst = torch.full((3,), 9.0)
    assert land(src, dst, first=True, transfers=stats)
    assert dst.tolist() == [1.0, 2.0, 3.0]  # copied, the old values gone
    assert land(src, dst, first=False, transfers=stats)
    assert dst.tolist() == [2.0, 4.0, 6.0]  # added in place
    elsewhere = torch.empty(3, device="meta")
    assert not land(src, elsewhere, first=False, transfers=stats)  # the caller stages it
    # a 16-bit destination takes the values as they are (stage 1/2's 16-bit host shard)
    low = torch.zeros(3, dtype=torch.bfloat16)
    assert land(src.to(torch.bfloat16), low, first=True, transfers=stats)
    assert low.float().tolist() == [1.0, 2.0, 3.0]


def test_plan_pieces_of_a_rank_slice():
    a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    bucket = Bucket(index=0, group_index=0, start=0, numel=8, slots=(
        ParamSlot(param=a, name="a", flat_offset=0, global_offset=0, numel=5),
        ParamSlot(param=b, name="b", flat_offset=5, global_offset=5, numel=3)))
    # world 2, rank 1: the slice is flat [4, 8); pieces of 3 -> [4, 7) (a and b), [7, 8) (b)
    pieces, of_param = plan_pieces([bucket], rank=1, world=2, piece_numel=3, early=True)
    assert [(p.key, p.slice_lo, p.numel, p.params) for p in pieces[0]] == [(0, 0, 3, 2),
                                                                          (1, 3, 1, 1)]
    assert [p.key for p in of_param[id(a)]] == [0]
    assert [p.key for p in of_param[id(b)]] == [0, 1]
    _, none = plan_pieces([bucket], rank=0, world=2, piece_numel=3, early=False)
    assert none == {}
