"""engine.stats()["breakdown"] ([Note: step breakdown] in zeroio/tiering/breakdown.py) against
hand measurements.

The host step (offload_optimizer cpu) is made slow on purpose: CPU Adam sleeps ``DELAY`` per
chunk (a monkeypatched ``ChunkedStep.update`` that also records the numel of every chunk it
is given, per step). The test times every engine call with its own ``perf_counter`` and, with
``overlap_step``, sleeps ``GAP`` between a step and the next forward. Then, for stages 2 and 3,
overlap off and on:
- the chunks of a step are exactly the chunks CPU Adam was called with, and their numel sums
  to the model's parameter count (hand count: the shard at world 1);
- CPU Adam and the worker's seconds are at least the sleeps; each chunk lasts at least one;
- without overlap the training thread waits inside ``step()`` for about the whole host step
  (nothing hidden); with overlap ``step()`` never waits, the next forward's pre-hooks wait
  for what the gap did not cover (bracketed by the hand-timed forward and the sleeps), and the
  gap itself is hidden; the last step is waited for by ``stats()`` (reader ``synchronize``);
- wall, forward, backward and step seconds match the hand timings (each inside its hand-timed
  call, together nearly all of them);
- ``total`` is the sum of the per-step records; no bytes cross PCIe without a device;
- ``wall_clock_breakdown`` prints each record once it is closed: at its own step without
  overlap, one step later with it.
The GPU-only parts (CUDA events, the step assist's chunks) are checked on fake events below and
on a GPU in tests/test_stats.py.
"""

from __future__ import annotations

import pytest

from zeroio.testing import run_ranks

DELAY = 0.04
GAP = 0.02
STEPS = 3
NUMEL = 8 * 32 + 32 + 32 * 4 + 4  # Linear(8, 32) + Linear(32, 4), weights and biases


def _body(stage, overlap):
    import contextlib
    import io
    import time

    import torch

    import zeroio
    from zeroio.optim.adam import ChunkedStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"},
            "tiering": {"overlap_step": overlap}}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "steps_per_print": 1, "wall_clock_breakdown": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    calls: dict[int, list[int]] = {}
    tag = [0]
    update = ChunkedStep.update

    def slow(self, gi, lo, n, **kw):
        time.sleep(DELAY)
        calls.setdefault(tag[0], []).append(n)
        return update(self, gi, lo, n, **kw)

    hand = []
    err = io.StringIO()
    ChunkedStep.update = slow
    try:
        with contextlib.redirect_stderr(err):
            for k in range(1, STEPS + 1):
                if overlap and k > 1:
                    time.sleep(GAP)
                x = torch.randn(4, 8)
                t0 = time.perf_counter()
                loss = engine(x).pow(2).mean()
                t1 = time.perf_counter()
                engine.backward(loss)
                t2 = time.perf_counter()
                tag[0] = k
                engine.step()
                t3 = time.perf_counter()
                hand.append({"fwd": (t0, t1), "bwd": (t1, t2), "step": (t2, t3)})
            stats = engine.stats()
    finally:
        ChunkedStep.update = update
    engine.close()
    return stats, calls, hand, err.getvalue()


@pytest.fixture(scope="module", params=[(2, False), (2, True), (3, False), (3, True)],
                ids=["z2", "z2-overlap", "z3", "z3-overlap"])
def run(request):
    stage, overlap = request.param
    (out,) = run_ranks(_body, 1, stage, overlap)
    return overlap, out


def test_chunks_are_the_cpu_adam_calls_and_cover_the_shard(run):
    _, (stats, calls, _, _) = run
    bd = stats["breakdown"]
    assert bd["steps"] == STEPS == stats["global_steps"]
    assert [r["step"] for r in bd["recent"]] == list(range(1, STEPS + 1))
    for r in bd["recent"]:
        assert sum(calls[r["step"]]) == NUMEL
        assert r["numel_cpu"] == NUMEL and r["numel_gpu"] == 0
    last = bd["last"]
    assert [c["numel"] for c in last["chunks"]] == calls[STEPS]
    assert all(c["device"] == "cpu" for c in last["chunks"])
    for c in last["chunks"]:  # each chunk holds one sleep, inside the worker's span
        assert c["end"] - c["start"] >= DELAY * 0.95
        assert last["host_start_s"] - 1e-6 <= c["start"] <= c["end"] <= last["host_end_s"] + 1e-6


def test_host_step_seconds_bracket_the_sleeps(run):
    _, (stats, calls, _, _) = run
    for r in stats["breakdown"]["recent"]:
        slept = len(calls[r["step"]]) * DELAY
        assert r["host_adam_s"] >= slept * 0.95
        assert r["host_worker_s"] >= r["host_adam_s"] + r["host_publish_s"] - 1e-6
        assert r["host_span_s"] == pytest.approx(r["host_worker_s"], abs=1e-6)
        assert r["hidden_s"] == pytest.approx(max(0.0, r["host_span_s"] - r["waited_total_s"]))


def test_waits_by_reader(run):
    overlap, (stats, calls, hand, _) = run
    recent = stats["breakdown"]["recent"]
    if not overlap:  # step() waits for its own host step: nothing is hidden
        for r in recent:
            slept = len(calls[r["step"]]) * DELAY
            assert r["waited_s"]["step"] >= slept * 0.95
            assert r["waited_s"]["step"] <= r["step_s"]
            assert r["waited_total_s"] == r["waited_s"]["step"]
            assert r["hidden_s"] < 0.5 * r["host_span_s"]
        return
    for r in recent[:-1]:  # the next forward waits for what the gap did not cover
        k = r["step"]
        w = r["waited_s"]
        assert w["step"] == 0.0 and w["synchronize"] == 0.0
        fwd0, fwd1 = hand[k]["fwd"]  # step k + 1's forward (hand is 0-based)
        step0 = hand[k - 1]["step"][0]
        slept = len(calls[k]) * DELAY
        assert w["forward"] <= fwd1 - fwd0 + 1e-3
        # the host step began after step() was entered and ran at least its sleeps
        assert w["forward"] >= step0 + slept - fwd0 - 2e-3
        assert r["hidden_s"] >= GAP * 0.5
    last = recent[-1]  # nothing ran after it but stats(), which waited for it
    assert last["waited_s"]["forward"] == 0.0 and last["waited_s"]["synchronize"] > 0


def test_wall_and_phases_match_hand_timings(run):
    _, (stats, _, hand, _) = run
    recent = stats["breakdown"]["recent"]
    measured = timed = 0.0
    for r, h in zip(recent, hand, strict=True):
        for name, key in (("fwd", "forward_s"), ("bwd", "backward_s"), ("step", "step_s")):
            t0, t1 = h[name]
            assert 0 < r[key] <= t1 - t0  # inside the hand-timed call
            measured, timed = measured + r[key], timed + t1 - t0
    assert measured >= 0.9 * timed - 5e-3  # all of it (a preempted call may lose a little)
    for r, h0, h1 in zip(recent[1:], hand[:-1], hand[1:], strict=True):
        assert r["wall_s"] == pytest.approx(h1["step"][1] - h0["step"][1], abs=1e-2)
        assert r["other_s"] == pytest.approx(
            r["wall_s"] - r["forward_s"] - r["backward_s"] - r["step_s"], abs=1e-9)
    spans = stats["breakdown"]["last"]["spans"]
    assert [s["name"] for s in spans] == ["forward", "backward", "step"]
    assert 0 <= spans[0]["start"] <= spans[-1]["end"] <= stats["breakdown"]["last"]["wall_s"]


def test_total_is_the_sum_of_steps_and_no_pcie_without_a_device(run):
    from zeroio.tiering.breakdown import SUMMED

    _, (stats, _, _, _) = run
    bd = stats["breakdown"]
    for key in SUMMED:
        assert bd["total"][key] == pytest.approx(sum(r[key] for r in bd["recent"])), key
    for reader, v in bd["total"]["waited_s"].items():
        assert v == pytest.approx(sum(r["waited_s"][reader] for r in bd["recent"]))
    assert bd["total"]["h2d_bytes"] == bd["total"]["d2h_bytes"] == 0
    assert bd["total"]["gpu_busy_s"] is None  # no CUDA events on a CPU


def test_wall_clock_breakdown_prints_each_closed_record(run):
    overlap, (_, _, _, err) = run
    lines = [ln for ln in err.splitlines() if ln.startswith("[zeroio] step ")]
    assert len(lines) == STEPS
    tables = [ln for ln in err.splitlines() if ln.startswith("step ") and ": wall " in ln]
    closed = list(range(1, STEPS)) if overlap else list(range(1, STEPS + 1))
    assert [int(ln.split()[1].rstrip(":")) for ln in tables] == closed
    if overlap:
        assert "no step recorded yet" in err


# ---- the record from fake CUDA events (the GPU's parts on a CPU) ----------------------------

class FakeEvent:
    """A CUDA event that completed at GPU time ``t`` (seconds)."""

    def __init__(self, t, done=True):
        self.t, self.done, self.synced = t, done, False

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3

    def query(self):
        return self.done

    def synchronize(self):
        self.synced = self.done = True


def test_record_from_events_by_hand():
    from zeroio.tiering.breakdown import HostRecord, _Window, format_breakdown, step_record

    # host clock: the window is [9.5, 10.4]; the GPU clock reads 100.0 at host time 10.0
    w = _Window(step=7, start=9.5, end=10.4, anchor=(10.0, FakeEvent(100.0)),
                moved={"cpu->gpu": 3000, "gpu->cpu": 5000, "nvme->cpu": 9},
                spans=[("forward", 9.6, 9.8, FakeEvent(99.6), FakeEvent(99.75)),
                       ("backward", 9.8, 9.9, FakeEvent(99.8), FakeEvent(99.85)),
                       ("step", 9.9, 10.1, None, None)])
    host = HostRecord(phases={"worker": 0.5, "adam": 0.3, "publish": 0.05}, worker=(10.0, 10.5))
    host.add_chunk(10.0, 10.2, 100, "cpu")
    host.add_chunk(10.2, 10.2, 50, "gpu", (FakeEvent(100.05), FakeEvent(100.25)))
    host.add_chunk(10.2, 10.2, 30, "gpu", (FakeEvent(100.2), FakeEvent(100.3)))
    host.add_wait("forward", 10.3, 10.4)
    r = step_record(w, host)
    assert r["wall_s"] == pytest.approx(0.9)
    assert r["forward_s"] == pytest.approx(0.2) and r["backward_s"] == pytest.approx(0.1)
    assert r["step_s"] == pytest.approx(0.2) and r["other_s"] == pytest.approx(0.4)
    assert r["gpu_busy_s"] == pytest.approx(0.15 + 0.05)
    assert r["h2d_bytes"] == 3000 and r["d2h_bytes"] == 5000
    assert r["host_span_s"] == pytest.approx(0.5) and r["host_start_s"] == pytest.approx(0.5)
    assert r["waited_s"]["forward"] == pytest.approx(0.1) and r["waited_total_s"] == pytest.approx(0.1)
    assert r["hidden_s"] == pytest.approx(0.4) and r["hidden_fraction"] == pytest.approx(0.8)
    assert r["numel_cpu"] == 100 and r["numel_gpu"] == 80
    # GPU chunks on the host clock through the anchor: 0.5 s after the start, plus GPU time
    gpu = [c for c in r["chunks"] if c["device"] == "gpu"]
    assert gpu[0]["start"] == pytest.approx(0.55) and gpu[0]["end"] == pytest.approx(0.75)
    assert gpu[1]["start"] == pytest.approx(0.70) and gpu[1]["end"] == pytest.approx(0.80)
    assert r["assist_gpu_s"] == pytest.approx(0.25)  # union of [0.05, 0.25] and [0.2, 0.3]
    text = format_breakdown(r)
    assert text.splitlines()[0] == "step 7: wall 0.900s"
    assert "forward       0.200  22.2%  0.100" in text
    assert "h2d 0.00MB d2h 0.01MB, gpu busy 0.200s" in text
    assert "cpu 100 el, gpu 80 el (44%) in 0.250s" in text


def test_record_waits_for_its_host_step_and_events():
    import torch

    from zeroio.tiering.breakdown import HostRecord, StepTimeline

    class Clock:
        busy = True

        def __init__(self):
            self.rec = HostRecord()

        def peek(self):
            return self.rec

        def take(self):
            rec, self.rec = self.rec, HostRecord()
            return rec

        def reading(self, name):
            import contextlib
            return contextlib.nullcontext()

    clock = Clock()
    tl = StepTimeline(torch.device("cpu"), clock)
    with tl.span("forward"):
        pass
    late = FakeEvent(1.0, done=False)
    clock.rec.add_chunk(0.0, 0.0, 10, "gpu", (FakeEvent(0.5), late))
    tl.boundary(1, {})
    assert tl.pending and tl.last is None  # the worker is still busy
    clock.busy = False
    tl.settle()
    assert tl.pending and not late.synced  # its GPU chunk has not finished: not read yet
    tl.settle(force=True)
    assert not tl.pending and late.synced
    assert tl.last["step"] == 1 and tl.last["numel_gpu"] == 10
    assert tl.as_dict()["steps"] == 1
