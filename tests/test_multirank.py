"""The multi-rank harness itself: results come back by rank, failures carry the rank's traceback."""

import pytest

from zeroio.errors import RankFailedError
from zeroio.testing import run_ranks


def _all_reduce_body(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return "ok"


def _hang_on_rank_zero():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(60)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_reduce_result_checked(world):
    results = run_ranks(_all_reduce_body, world, 10.0)
    # hand computation: sum over ranks r of (r + 10)
    expected = sum(r + 10.0 for r in range(world))
    assert results == [(r, world, expected) for r in range(world)]


def test_rank_failure_reraises_with_traceback():
    with pytest.raises(RankFailedError) as info:
        run_ranks(_fail_on_rank_one, 2)
    assert info.value.rank == 1
    assert "boom on rank one" in str(info.value)
    assert "ValueError" in info.value.traceback_text


def test_timeout_kills_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_ranks(_hang_on_rank_zero, 2, timeout=10)


def _read_env_at_start():
    # /proc/self/environ is the environment the process was started with
    with open("/proc/self/environ", "rb") as f:
        start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return start.get(b"ZEROIO_TEST_START_ENV", b"").decode()


def test_env_is_present_from_process_start():
    import os

    assert run_ranks(_read_env_at_start, 2, env={"ZEROIO_TEST_START_ENV": "yes"}) == ["yes", "yes"]
    assert "ZEROIO_TEST_START_ENV" not in os.environ


def _tensors_body(n):
    import torch
    import torch.distributed as dist

    r = dist.get_rank()
    return [torch.full((4096,), float(r * 1000 + i)) for i in range(n)]


def test_tensor_results_arrive_after_the_rank_is_done():
    """A result holding CPU tensors travels as file descriptors the parent fetches from the
    rank while unpickling; the rank must still be alive then (it waits for the parent)."""
    import torch

    out = run_ranks(_tensors_body, 2, 64, timeout=120)
    for r, tensors in enumerate(out):
        assert len(tensors) == 64
        for i, t in enumerate(tensors):
            assert torch.equal(t, torch.full((4096,), float(r * 1000 + i)))


def _how_started(name):
    import os
    import sys

    with open("/proc/self/environ", "rb") as f:
        start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return (os.getppid(), start.get(name.encode(), b"").decode(), os.environ.get(name),
            "torch" in sys.modules)


def test_ranks_fork_from_the_preloaded_server_only_when_the_environment_matches(monkeypatch):
    """With this process's environment unchanged since the forkserver started, ranks are forked
    from it (their parent is the server, not this process; torch is already imported). With a
    variable changed, a forked rank would start with the server's stale environment, so the
    job runs on spawned ranks: their parent is this process and the variable is there from
    process start, as in the environment they run with."""
    import os

    monkeypatch.delenv("ZEROIO_TEST_FORK_ENV", raising=False)
    run_ranks(_how_started, 1, "ZEROIO_TEST_FORK_ENV")  # the server is up from here on
    forked = run_ranks(_how_started, 2, "ZEROIO_TEST_FORK_ENV")
    assert all(ppid != os.getpid() for ppid, *_ in forked), forked
    assert [rest for _, *rest in forked] == [["", None, True]] * 2
    monkeypatch.setenv("ZEROIO_TEST_FORK_ENV", "changed")
    spawned = run_ranks(_how_started, 2, "ZEROIO_TEST_FORK_ENV")
    assert [s[:3] for s in spawned] == [(os.getpid(), "changed", "changed")] * 2
