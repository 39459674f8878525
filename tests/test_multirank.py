"""The multi-rank harness itself: results come back by rank, failures carry the rank's traceback."""

import pytest

from zeroio.errors import RankFailedError
from zeroio.testing import fork_identity, multirank, run_ranks


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
    # a spawn here names what made it spawn: something earlier in the run changed this
    # process's environment or code for good, and every later job pays a spawn
    assert multirank.LAST_START == {"start": "fork", "why": []}, multirank.LAST_START
    assert all(ppid != os.getpid() for ppid, *_ in forked), forked
    assert [rest for _, *rest in forked] == [["", None, True]] * 2
    monkeypatch.setenv("ZEROIO_TEST_FORK_ENV", "changed")
    spawned = run_ranks(_how_started, 2, "ZEROIO_TEST_FORK_ENV")
    assert multirank.LAST_START == {"start": "spawn",
                                    "why": ["environment variable ZEROIO_TEST_FORK_ENV"]}
    assert [s[:3] for s in spawned] == [(os.getpid(), "changed", "changed")] * 2


def test_a_variable_inductor_sets_in_process_keeps_ranks_forking(monkeypatch):
    """torch's inductor sets ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`` in this process each
    time it loads a compiled kernel (any in-process compile earlier in the run); it is read
    by that kernel as it loads, never at start, so jobs still fork and the rank sees this
    process's value, as a spawned rank would."""
    import os

    run_ranks(_how_started, 1, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "140000000000")
    out = run_ranks(_how_started, 2, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
    assert multirank.LAST_START == {"start": "fork", "why": []}, multirank.LAST_START
    assert [(ppid != os.getpid(), start, now) for ppid, start, now, _ in out] == [
        (True, "", "140000000000")] * 2


def _module_file(name):
    import importlib

    return importlib.import_module(name).__file__


def test_ranks_spawn_when_a_preloaded_module_would_be_imported_from_elsewhere(
        tmp_path, monkeypatch):
    """The server imported ``quopri`` (through torch) from the standard library. With a folder
    holding another ``quopri`` first on this process's ``sys.path``, a spawned rank imports
    that one: a forked rank would run other code than a spawned one, so the job spawns and
    the ranks hold the module from the folder."""
    import quopri

    shadow = tmp_path / "quopri.py"
    # the same code, from another file
    shadow.write_text(f"exec(compile(open({quopri.__file__!r}).read(), {str(shadow)!r}, 'exec'))\n")
    run_ranks(_module_file, 1, "quopri")
    assert multirank.LAST_START["start"] == "fork", multirank.LAST_START
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_ranks(_module_file, 2, "quopri") == [str(shadow)] * 2
    assert multirank.LAST_START == {
        "start": "spawn", "why": ["module quopri would be imported from elsewhere"]}


def test_a_module_file_changed_since_it_was_loaded_is_named(tmp_path, monkeypatch):
    """A module file edited after the server read it: a spawned rank would read the new code,
    so the check names the module (its size or modification time differs from the record)."""
    import importlib
    import sys

    src = tmp_path / "zeroio_fork_probe.py"
    src.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zeroio_fork_probe", raising=False)
    importlib.import_module("zeroio_fork_probe")
    loaded = fork_identity.snapshot()
    assert fork_identity.changed_files(loaded) == []
    src.write_text("VALUE = 22\n")  # one byte longer
    assert fork_identity.changed_files(loaded) == ["zeroio_fork_probe"]
    src.write_text("VALUE = 3\n")  # the old size: the modification time tells
    import os

    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, loaded["zeroio_fork_probe"][1][0] + 1))
    assert fork_identity.changed_files(loaded) == ["zeroio_fork_probe"]
    monkeypatch.delitem(sys.modules, "zeroio_fork_probe")


def _cuda_env_seen():
    import ctypes
    import os
    import sys

    import torch

    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    c_level = libc.getenv(b"CUDA_VISIBLE_DEVICES")
    return (os.getppid(), os.environ.get("CUDA_VISIBLE_DEVICES"),
            None if c_level is None else c_level.decode(), "torch" in sys.modules,
            torch.cuda.is_initialized(), torch.cuda.device_count())


def test_a_job_setting_cuda_visible_devices_forks_and_the_rank_sees_it_from_the_start(
        monkeypatch):
    """``CUDA_VISIBLE_DEVICES`` is read when CUDA initialises, not at process start: a job that
    sets it forks, the rank has it in ``os.environ`` and in the C-level environment the CUDA
    driver reads (libc's getenv), CUDA is not initialised there, and this process's
    environment is left as it was."""
    import os

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run_ranks(_how_started, 1, "CUDA_VISIBLE_DEVICES")  # the server is up from here on
    out = run_ranks(_cuda_env_seen, 2, env={"CUDA_VISIBLE_DEVICES": ""})
    assert multirank.LAST_START == {"start": "fork", "why": []}, multirank.LAST_START
    assert [(ppid != os.getpid(), *rest) for ppid, *rest in out] == [
        (True, "", "", True, False, 0)] * 2
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_job_setting_a_variable_not_known_safe_after_fork_spawns():
    """A variable outside ``SAFE_AFTER_FORK`` (one glibc reads at process start, here) makes
    the job spawn, naming it; the rank has it from process start."""
    import os

    run_ranks(_how_started, 1, "MALLOC_ARENA_MAX")
    out = run_ranks(_how_started, 1, "MALLOC_ARENA_MAX", env={"MALLOC_ARENA_MAX": "2"})
    assert multirank.LAST_START == {"start": "spawn", "why": [
        "environment variable MALLOC_ARENA_MAX set for the job (not in "
        "fork_identity.SAFE_AFTER_FORK)"]}
    assert out == [(os.getpid(), "2", "2", True)]


def test_safe_after_fork_splits_a_job_env_against_the_parent():
    late, why = fork_identity.set_after_fork(
        {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "ZEROIO_CPU_ADAM": "torch"},
        {"OMP_NUM_THREADS": "1"})
    # OMP_NUM_THREADS is already the parent's value: nothing to set, no reason to spawn
    assert late == {"CUDA_VISIBLE_DEVICES": "", "ZEROIO_CPU_ADAM": "torch"}
    assert why == []
    _, why = fork_identity.set_after_fork({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "1"})
    assert why == ["environment variable OMP_NUM_THREADS set for the job (not in "
                   "fork_identity.SAFE_AFTER_FORK)"]


def test_cuda_touched_in_the_server_is_a_difference(tmp_path, monkeypatch):
    """CUDA initialised (as the forked rank sees the server's state) always counts; the CUDA
    driver library in the process map counts where the job sets a CUDA variable."""
    import torch

    clean = tmp_path / "maps"
    clean.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    driver = tmp_path / "maps_driver"
    driver.write_text("7f00-7f01 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.1\n")
    cuda_env = {"CUDA_VISIBLE_DEVICES": ""}
    assert fork_identity.cuda_differences(cuda_env, str(clean)) == []
    assert fork_identity.cuda_differences(cuda_env, str(driver)) == [
        "the CUDA driver library loaded in the server"]
    assert fork_identity.cuda_differences({"ZEROIO_CPU_ADAM": "torch"}, str(driver)) == []
    assert fork_identity.cuda_differences(cuda_env, str(tmp_path / "absent")) == [
        "the CUDA driver library loaded in the server"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fork_identity.cuda_differences(None, str(clean)) == ["CUDA initialised in the server"]


def test_a_safe_variable_changed_in_this_process_keeps_ranks_forking(monkeypatch):
    """A ``SAFE_AFTER_FORK`` variable this process set after the server started (a test's
    ``monkeypatch.setenv``) does not make the job spawn: the forked rank has this process's
    value, as a spawned one would, though its start environment is the server's."""
    import os

    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)
    run_ranks(_how_started, 1, "ZEROIO_CPU_ADAM")
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")
    out = run_ranks(_how_started, 2, "ZEROIO_CPU_ADAM")
    assert multirank.LAST_START == {"start": "fork", "why": []}, multirank.LAST_START
    assert [(ppid != os.getpid(), *rest) for ppid, *rest in out] == [
        (True, "", "torch", True)] * 2
