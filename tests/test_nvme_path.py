"""The NVMe optimizer path moves what the host budget forces, once, overlapped with Adam.

A ``DiskModel`` backend (zeroio/testing/disk_model.py) stands in for the disk: one transfer
at a time at a fixed bandwidth (sleeps), logging every read and write as it is issued.
Against it:

- the bytes each step reads and writes equal the hand count of [Note: resident head,
  streamed tail] in zeroio/optim/swap.py, no piece is read twice without having been
  written in between, and moments that fit in the budget are never written during
  training (two slow runs of the peers benchmark: a flush after every sub-group wrote every
  moment every step, synchronously);
- with Adam slowed down as well, a step takes about max(Adam, disk) rather than their sum;
- results equal plain single-process AdamW (zeroio.testing.reference) for stage 2 and
  stage 3 with the optimizer on NVMe and a budget that forces streaming, on 1 and 2 ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zeroio
from zeroio.optim.adam import ShardedAdam
from zeroio.optim.swap import SwappedAdam
from zeroio.partition.base import Segment, ShardGroup
from zeroio.testing import run_ranks
from zeroio.testing.disk_model import DiskModel
from zeroio.tiering import MemoryBackend

PAGE = 4096
PIECE = PAGE // 4  # one page per moment: host costs are exact
HYPER = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1},
         {"lr": 3e-3, "betas": (0.8, 0.999), "eps": 1e-6, "weight_decay": 0.0}]


def _groups(sizes, seed=0):
    torch.manual_seed(seed)
    out, off = [], 0
    for i, n in enumerate(sizes):
        out.append(ShardGroup(group_index=i, master=torch.randn(n), grad=torch.zeros(n), numel=n,
                              segments=(Segment(local_offset=0, global_offset=off, numel=n),)))
        off += n
    return out


def _cfg(tmp_path, *, budget=None, read=True, write=True, sub_group_size=10 * PIECE):
    tiering = {} if budget is None else {"tiering": {"cpu_budget_bytes": budget}}
    return zeroio.load_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "sub_group_size": sub_group_size, **tiering, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": read,
            "pipeline_write": write}}})


def _steps(opts_and_groups, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        grads = [torch.randn(x.numel, generator=g) for x in opts_and_groups[0][1]]
        for opt, groups in opts_and_groups:
            for x, grad in zip(groups, grads, strict=True):
                x.grad.copy_(grad)
            opt.step(grad_scale=2.0)


@pytest.mark.parametrize("read,write", [(True, True), (False, False)])
def test_streaming_moves_what_the_budget_forces(read, write, tmp_path):
    sizes = (20 * PIECE, 12 * PIECE)  # 32 pieces of one page per moment
    pieces, pair = 32, 2 * PAGE
    budget = pieces * pair // 4  # a quarter of the moments
    window = (1 + (3 if read else 0)) * pair  # the current piece and 3 read ahead
    resident = (budget - window) // pair  # hand count: 4 with read-ahead, 7 without
    streamed = pieces - resident
    disk = DiskModel()
    a, b = _groups(sizes), _groups(sizes)
    swapped = SwappedAdam(a, HYPER, decoupled=True, cfg=_cfg(tmp_path, budget=budget, read=read,
                                                              write=write),
                          backend=disk, piece_elems=PIECE)
    plain = ShardedAdam(b, HYPER, decoupled=True)
    assert (len(swapped.pieces), swapped.plan.resident) == (pieces, resident)
    steps = 5
    _steps([(swapped, a), (plain, b)], steps)
    swapped.drain()
    names = [p.name(k) for p in swapped.pieces for k in ("exp_avg", "exp_avg_sq")]
    head = set(names[2 * resident:2 * (resident + swapped.plan.read_ahead)])  # next step's start
    for i, name in enumerate(names):
        is_streamed = i >= 2 * resident
        # step 1 reads nothing (the moments are zeros on a disk never written); each later
        # step reads each streamed piece once; read-ahead has also loaded the head of step 6's
        # stream
        want_reads = (steps - 1) * is_streamed + (name in head)
        assert disk.count("read", name) == want_reads * PAGE, name
        # write-behind writes each streamed piece in its step; without it the last one is still
        # dirty in memory (written when its space is next needed)
        last_piece = i >= len(names) - 2
        want_writes = steps * is_streamed - (last_piece and not write)
        assert disk.count("write", name) == want_writes * PAGE, name
    # a piece is read again only after it was written (else a clean copy was dropped and re-read)
    last: dict[str, str] = {}
    for op, name, _ in disk.log:
        if op == "read":
            assert last.get(name) in (None, "write"), f"{name} read twice without a write between"
        last[name] = op
    stats = swapped.store.stats()
    assert stats["bytes_moved"]["nvme->cpu"] == disk.count("read")
    assert stats["bytes_moved"]["cpu->nvme"] == disk.count("write") == \
        (steps * streamed - (not write)) * pair
    assert swapped.plan.streamed_bytes == streamed * pair
    for i in range(2):
        torch.testing.assert_close(a[i].master, b[i].master, rtol=1e-6, atol=1e-6)
        for kind in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(swapped.local_tensor(i, kind), plain.local_tensor(i, kind),
                                       rtol=1e-6, atol=1e-9)
        assert swapped.steps_taken(i) == steps
    swapped.close()


def test_moments_that_fit_are_never_written_during_training(tmp_path):
    """DeepSpeed's defaults (no pipeline flags, 1e9-element sub-groups, budget derived from
    buffer_count sub-groups): every moment fits, so after step 1 no byte moves at all."""
    disk = DiskModel()
    a = _groups((3 * PIECE, 2 * PIECE + 7))
    swapped = SwappedAdam(a, HYPER, decoupled=True, backend=disk,
                          cfg=_cfg(tmp_path, read=False, write=False, sub_group_size=10**9))
    assert swapped.plan.resident == len(swapped.pieces)
    _steps([(swapped, a)], 1)
    swapped.drain()
    after_first = len(disk.log)
    assert disk.count("write") == 0
    _steps([(swapped, a)], 3)
    swapped.drain()
    assert disk.log[after_first:] == []
    last = swapped.store.stats()["last_step"]
    assert last["bytes_moved"] == {} and last["writebacks"] == 0
    # and the moments are still right: flushing writes them (once) and they read back
    before = swapped.local_tensor(0, "exp_avg").clone()
    swapped.store.flush()
    assert disk.count("write") == sum(2 * p.numel * 4 for p in swapped.pieces)
    assert torch.equal(swapped.local_tensor(0, "exp_avg"), before)
    swapped.close()


def test_disk_transfers_run_while_adam_runs(tmp_path, monkeypatch):
    """The streamed step overlaps the disk with CPU Adam: reads of the next pieces and
    write-backs of the previous ones are in flight while a piece is updated. Checked on the
    order of events (a timeline of Adam calls and disk transfers), not on wall-clock totals,
    so a loaded CI machine cannot flip it; the step time against the disk bound is measured
    on the GPU machine (benchmarks/train_peers.py, zeroio-z3-nvme-stream)."""
    import zeroio.optim.swap as swap

    timeline: list[tuple[str, int]] = []
    lock = threading.Lock()
    io_busy = [0]

    def mark(kind):
        with lock:
            timeline.append((kind, io_busy[0]))

    real = swap.adam_update

    def slow_adam(**kw):
        mark("adam_begin")
        time.sleep(0.006)
        real(**kw)
        mark("adam_end")

    class TimedDisk(DiskModel):
        def _busy(self, nbytes):
            with lock:
                io_busy[0] += 1
                timeline.append(("io_begin", io_busy[0]))
            try:
                super()._busy(nbytes)
            finally:
                with lock:
                    io_busy[0] -= 1

    monkeypatch.setattr(swap, "adam_update", slow_adam)
    pieces, pair = 32, 2 * PAGE
    disk = TimedDisk(bandwidth=PAGE / 0.003)
    a = _groups((32 * PIECE,))
    swapped = SwappedAdam(a, HYPER[:1], decoupled=True, backend=disk, piece_elems=PIECE,
                          cfg=_cfg(tmp_path, budget=pieces * pair // 4, sub_group_size=10**9))
    streamed = pieces - swapped.plan.resident
    assert streamed > pieces // 2
    _steps([(swapped, a)], 2)  # step 1 reads zeros for every piece: not steady state
    timeline.clear()
    _steps([(swapped, a)], 1)
    swapped.drain()
    # an Adam call overlaps the disk when a transfer is in flight as it starts, or one
    # starts before it ends
    overlapped, calls, inside = 0, 0, None
    for kind, busy in timeline:
        if kind == "adam_begin":
            calls += 1
            inside = busy > 0
        elif kind == "io_begin" and inside is False:
            inside = True
        elif kind == "adam_end":
            overlapped += bool(inside)
            inside = None
    assert calls == pieces
    # the streamed pieces' updates have disk work beside them (a serial swap would have none)
    assert overlapped >= streamed // 2, (overlapped, streamed, calls)
    swapped.close()


def test_budget_below_one_piece_is_capacity_error(tmp_path):
    with pytest.raises(zeroio.CapacityError, match="cpu_budget_bytes"):
        SwappedAdam(_groups((4 * PIECE,)), HYPER[:1], decoupled=True, backend=MemoryBackend(),
                    piece_elems=PIECE, cfg=_cfg(tmp_path, budget=PAGE))


# -- engine: stage 2 and stage 3, streaming, against plain AdamW ---------------------------

STEPS, LR, CLIP = 4, 1e-2, 1.0


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 40),
                               torch.nn.Tanh(), torch.nn.Linear(40, 5))


def _config(tmpdir, stage, rank, budget):
    import os

    tiering = {} if budget is None else {"cpu_budget_bytes": budget}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": stage, "sub_group_size": 256, "tiering": tiering,
                "offload_optimizer": {"device": "nvme", "pipeline_read": True,
                                      "pipeline_write": True,
                                      "nvme_path": os.path.join(tmpdir, f"s{stage}-r{rank}")}}}


def _held_host_bytes(cfg, init):
    model = _mlp()
    model.load_state_dict(init)
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    held = engine.stats()["sources"]["held"]["tiers"]["cpu"]["used_bytes"]
    engine.close()
    return held


def _engine_body(tmpdir, stage):

    import torch.distributed as dist

    from zeroio.testing.reference import adamw_reference

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _mlp().state_dict().items()}
    g = torch.Generator().manual_seed(7)
    batches = [[(torch.randn(world * 2, 24, generator=g), torch.randn(world * 2, 5, generator=g))]
               for _ in range(STEPS)]
    ref = _mlp()
    ref.load_state_dict(init)
    ref_losses, ref_params = adamw_reference(
        ref, batches, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        lr=LR, weight_decay=0.01, clip=CLIP)
    model = _mlp()
    model.load_state_dict(init)
    numel = sum(p.numel() for p in model.parameters())
    local = -(-numel // world)
    del local
    # the optimizer's share: a window of 4 pieces (sub-groups of 256: a page per moment) + 2
    # resident; cpu_budget_bytes also counts the host state outside the store (masters,
    # gradients, flat buffers: [Note: budgets in training]), read off an unbudgeted engine
    budget = 6 * 2 * PAGE + _held_host_bytes(_config(tmpdir, stage, rank, None), init)
    cfg = _config(tmpdir, stage, rank, budget)
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    opt = engine.optimizer
    losses = []
    for (x, y), in batches:
        loss = torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    opt.drain()
    moved = opt.store.stats()["bytes_moved"]
    plan = opt.plan
    head = sum(2 * 4 * p.numel for p in plan.pieces[plan.resident:plan.resident + plan.read_ahead])
    everything = sum(2 * 4 * p.numel for p in plan.pieces)
    masters = {}
    flat = torch.zeros(engine.partitioner.index.total_numel, dtype=torch.float64)
    for grp in engine.partitioner.groups:
        master = opt.local_tensor(grp.group_index, "fp32")
        for s in grp.segments:
            flat[s.global_offset:s.global_offset + s.numel] = \
                master[s.local_offset:s.local_offset + s.numel].double()
    dist.all_reduce(flat)
    for e in engine.partitioner.index.entries:
        masters[e.name] = flat[e.offset:e.offset + e.numel].view(e.shape).float()
    engine.close()
    return dict(
        loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        max_diff=max((masters[n] - ref_params[n]).abs().max().item() for n in ref_params),
        streamed=plan.streamed_bytes, resident=plan.resident, pieces=len(plan.pieces),
        requests=opt.store.stats()["misses"] + opt.store.stats()["hits"],
        want_requests=2 * (len(plan.pieces) + (STEPS - 1) * (len(plan.pieces) - plan.resident)
                           + plan.read_ahead),
        read=moved.get("nvme->cpu", 0), wrote=moved.get("cpu->nvme", 0),
        want_read=everything + (STEPS - 1) * plan.streamed_bytes + head,
        want_wrote=STEPS * plan.streamed_bytes)


@pytest.mark.parametrize("stage,world", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_engine_streaming_matches_plain_adamw(stage, world, tmp_path):
    for r in run_ranks(_engine_body, world, str(tmp_path), stage, timeout=240):
        assert r["resident"] < r["pieces"] and r["streamed"] > 0, r  # the budget forces streaming
        # each streamed piece is asked for once a step, resident ones once in all; a request
        # may find its piece still in memory when its write-behind has not landed yet
        # (few pieces here: the next step's read-ahead follows closely), never more reads
        assert r["requests"] == r["want_requests"], r
        assert r["read"] <= r["want_read"] and r["wrote"] == r["want_wrote"], r
        assert r["loss_rel"] < 1e-5, r
        assert r["max_diff"] < 2e-6, r
