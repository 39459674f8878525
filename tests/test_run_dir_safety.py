"""`zeroio train --output DIR`: one run at a time on DIR, and nothing lost that zeroio did not write.

The lock (DIR/zeroio.lock) is taken once per job: a second run on DIR is
refused naming the holder's pid and host, a dead holder's lock is taken over,
and the ranks a 2-rank run launches do not refuse their own parent's lock. A
fresh run deletes only the files zeroio listed as its own (DIR/zeroio-run.json);
with a file it did not write in model/, checkpoints/ or nvme/ it refuses before
launching, unless --overwrite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroio.cli.train import rundir
from zeroio.errors import ConfigError
from zeroio.testing.train_cli import train_here

ARGS = ["--steps", "1", "--seq-len", "64", "--micro-batch", "2", "--json", "--nproc", "1"]
USER_FILE = "MY_FINETUNED_WEIGHTS.bin"


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", rundir.ENV):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", "--output", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- the lock, in this process ----------------------------------------------------------


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    lock = rundir.acquire(tmp_path / "run")
    try:
        with pytest.raises(ConfigError) as e:
            rundir.acquire(tmp_path / "run")
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(e.value), str(e.value)
    finally:
        lock.release()
    assert not (tmp_path / "run").exists()  # the lock made the folder, nothing else was written
    rundir.acquire(tmp_path / "run").release()  # free again once released


def test_a_dead_holders_lock_is_taken_over_with_a_note(tmp_path):
    dead = _dead_pid()
    (tmp_path / rundir.LOCK).write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
    notes = []
    lock = rundir.acquire(tmp_path, say=notes.append)
    try:
        assert len(notes) == 1 and f"pid {dead}" in notes[0] and "gone" in notes[0], notes
        assert json.loads((tmp_path / rundir.LOCK).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_lock_naming_another_host_is_not_taken_over(tmp_path):
    (tmp_path / rundir.LOCK).write_text(json.dumps({"pid": 4242, "host": "node-17"}))
    with pytest.raises(ConfigError) as e:
        rundir.acquire(tmp_path, say=print)
    msg = str(e.value)
    assert "pid 4242 on host node-17" in msg and str(tmp_path / rundir.LOCK) in msg, msg
    assert json.loads((tmp_path / rundir.LOCK).read_text())["host"] == "node-17"


def test_what_zeroio_wrote_is_removed_and_nothing_else(tmp_path):
    out = tmp_path
    tag = out / "checkpoints" / "step4"
    (tag / "fp32" / "c").mkdir(parents=True)
    (tag / "fp32" / "c" / "0").write_bytes(b"x" * 10)
    rundir.record(out, [tag])
    (out / "checkpoints" / "mine.txt").write_text("user")  # not written by zeroio
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")
    rundir.record(out, [out / "model"])
    (out / "model" / "config.json").write_text('{"edited": 1}')  # changed since
    # a save interrupted by a crash: claimed before writing, never recorded as finished
    half = out / "checkpoints" / "step6"
    rundir.record(out, [half], claim=True)
    (half / "exp_avg" / "c").mkdir(parents=True)
    (half / "exp_avg" / "c" / "0").write_bytes(b"y" * 3)
    assert rundir.foreign(out) == [out / "checkpoints" / "mine.txt", out / "model" / "config.json"]
    rundir.remove_written(out, ("checkpoints", "model"), overwrite=False)
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["checkpoints", "checkpoints/mine.txt", "model", "model/config.json",
                    rundir.WRITTEN]
    # only the changed file is still listed (as what zeroio once wrote there, for the message)
    assert list(json.loads((out / rundir.WRITTEN).read_text())["files"]) == ["model/config.json"]
    with pytest.raises(ConfigError, match="config.json \\(changed since zeroio wrote it\\)"):
        rundir.refuse_foreign(out, rundir.PARTS)


# -- zeroio train end to end --------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rundir")
    out = root / "run"
    res = {}
    # 2 ranks: the launched ranks must not refuse their parent's lock
    res["first"] = _train(out, *ARGS[:-2], "--steps", "2", "--save-every", "1", "--nproc", "2")
    res["first_files"] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    (out / "model" / USER_FILE).write_bytes(b"days of compute")
    (out / "notes.txt").write_text("mine")
    # refused before any rank starts: the command's own main, in this process
    res["refused"] = train_here(out, ARGS)
    res["after_refusal"] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    lock = rundir.acquire(out)  # this test process is now "another run" on DIR
    try:
        res["concurrent"] = train_here(out, ARGS)  # a second open file: flock refuses it
    finally:
        lock.release()
    (out / "model" / USER_FILE).rename(root / USER_FILE)  # the user moves the file away
    res["fresh"] = _train(out, *ARGS)
    res["after_fresh"] = sorted(p.name for p in (out / "checkpoints").iterdir())
    (out / "checkpoints" / "keep.txt").write_text("user's")
    res["overwrite"] = _train(out, *ARGS, "--overwrite")
    return out, res


@pytest.mark.slow
def test_two_ranks_run_under_their_parents_lock(runs):
    out, res = runs
    assert _ok(res["first"])["world_size"] == 2
    assert "zeroio.lock" not in res["first_files"]  # released at exit
    listed = json.loads((out / rundir.WRITTEN).read_text())["files"]
    assert "checkpoints/step1/manifest.json" in listed and "model/config.json" in listed


@pytest.mark.slow
def test_fresh_run_refuses_over_a_file_zeroio_did_not_write(runs):
    out, res = runs
    proc = res["refused"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert USER_FILE in proc.stderr and "--overwrite" in proc.stderr and "--output" in proc.stderr
    assert "Traceback" not in proc.stderr
    # nothing was deleted: the user's file and every checkpoint are where they were
    assert res["after_refusal"] == sorted([*res["first_files"], f"model/{USER_FILE}", "notes.txt"])


@pytest.mark.slow
def test_a_second_run_on_a_locked_dir_is_refused_naming_pid_and_host(runs):
    _, res = runs
    proc = res["concurrent"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_fresh_run_removes_only_what_zeroio_wrote(runs):
    out, res = runs
    assert _ok(res["fresh"])["end_step"] == 1
    # the old run's step2 (a higher step than this run reaches) is gone; the user's files are not
    assert res["after_fresh"] == ["latest", "step1"]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out.parent / USER_FILE).read_bytes() == b"days of compute"


@pytest.mark.slow
def test_overwrite_deletes_what_zeroio_did_not_write(runs):
    out, res = runs
    assert _ok(res["overwrite"])["end_step"] == 1
    assert not (out / "checkpoints" / "keep.txt").exists()  # asked for with --overwrite
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step1"]
    assert (out / "notes.txt").read_text() == "mine"  # outside model/, checkpoints/, nvme/
