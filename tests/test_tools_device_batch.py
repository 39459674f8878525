"""tools/device_batch.py: named suites fit the device tool's limits; a run packs what finished.

The suites are checked against the tool's limits (600 s per command, 2,000
characters, 8 carried paths), the GPU suites against the test files that carry
the gpu marker, and a run of a made-up suite of trivial shell steps (passing,
failing, one killed at its deadline, one writing a result) against the
tarball's members, the summary and the processes left behind.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

import device_batch as db  # noqa: E402

NAMED = {"gpu-tests", "gpu2-tests", "peers", "capacity", "train-default"}


def test_named_suites_exist_and_fit_one_run_call():
    assert NAMED <= set(db.SUITES)
    for s in db.SUITES.values():
        params = db.run_params(s, "0" * 40, "--extra '--start-layers 32'")
        assert len(params["command"]) <= 2000 and len(params["carry"]) <= 8
        assert params["timeout_s"] == 600 and params["kind"].startswith("nvidia-h200")
        assert params["command"].startswith(f"ZEROIO_COMMIT={'0' * 40} ")
        for step in s.steps:
            assert 0 < step.timeout_s <= db.BUDGET_S - s.setup_s
            cmd = db.expand(step, Path("/r"), Path("/n"), Path("/l"), "--x")
            assert "{" not in cmd.replace("${", "") and "git " not in cmd, cmd
            m = re.search(r"--timeout (\d+)", cmd)
            if m:  # the script's own deadline is inside the step's: it writes its failure row
                assert int(m.group(1)) < step.timeout_s, (s.name, step.name)


def test_over_the_tool_limits_is_an_error():
    with pytest.raises(ValueError, match="2000 characters"):
        db.run_params(db.SUITES["peers"], "c", "--extra " + "x" * 2000)


PARAM_MARK = "marks=pytest.mark." + "gpu"
"""A parameter marked gpu (spelt in two parts so this file does not match itself)."""


def _marked_by_hand() -> set[str]:
    out = set()
    for p in (REPO / "tests").glob("test_*.py"):
        for line in p.read_text().splitlines():
            if line.lstrip().startswith("@pytest.mark.gpu") or (
                    line.startswith("pytestmark") and "mark.gpu" in line) or (
                    "pytest.param(" in line and PARAM_MARK in line):
                out.add(p.name)
    return out


def test_gpu_suites_run_every_gpu_test_file():
    marked = _marked_by_hand()
    assert marked and "test_tools_device_batch.py" not in marked
    for name, kind in (("gpu-tests", "nvidia-h200"), ("gpu2-tests", "nvidia-h200-x2")):
        suite = db.SUITES[name]
        files = {m for s in suite.steps for m in re.findall(r"tests/(test_\w+\.py)", s.shell)}
        assert files == marked, files ^ marked
        assert suite.kind == kind and all(" -m gpu " in s.shell for s in suite.steps)


def test_peers_suite_runs_every_cpu_offload_contender_with_its_setup():
    suite = db.SUITES["peers"]
    only = {m.group(1): s for s in suite.steps if (m := re.search(r"--only (\S+)", s.shell))}
    import contenders

    assert set(only) == {"zeroio-z2-cpu", "zeroio-z3-cpu", "ds-z2-cpu", "ds-z3-cpu", "fsdp2-cpu",
                         "ds-z2-zenflow", "ds-z3-zenflow", "ds-z3-twinflow", "ds-z3-superoffload",
                         "torchao-cpu", "plain", "zeroio-z2-cpu-streamed", "zeroio-z3-cpu-streamed"}
    assert set(only) <= set(contenders.BY_NAME)
    assert "--steps 12" in only["ds-z2-zenflow"].shell  # two whole update windows of 4
    assert suite.peers and ".peers" in suite.carry
    for name, step in only.items():
        assert ("--libaio-dir" in step.shell) == name.startswith("ds-")
        assert "benchmarks/train_peers.py" in step.shell and "--nproc 1" in step.shell
    assert "--nproc 2" in db.SUITES["peers2"].steps[1].shell
    assert db.SUITES["peers2"].kind == "nvidia-h200-x2"


def test_dry_run_prints_every_expanded_step(capsys):
    assert db.main(["capacity", "--dry-run", "--extra", "--start-layers 32"]) == 0
    text = capsys.readouterr().out
    assert "benchmarks/probe_largest.py --plan-only" in text
    assert "--max-tries 1 --timeout 450 --out /tmp/zeroio-batch/capacity/results --start-layers 32" in text
    total = int(re.search(r"total (\d+) s", text).group(1))
    assert total == 30 + 30 + 465
    assert db.main(["peers", "--print-run", "--extra", "--set a.b=1", "--only", "ds-z2-cpu"]) == 0
    params = json.loads(capsys.readouterr().out)
    assert params["command"].endswith("--out $OUT --only ds-z2-cpu --extra '--set a.b=1'")
    assert params["carry"] == [".whl", ".peers"]


def _fake(tmp_path: Path) -> db.Suite:
    out = tmp_path / "OUT"
    return db.Suite("fake", "nvidia-h200", "test", (
        db.Step("hello", "echo hello-from-step; echo $ZEROIO_COMMIT $NCCL_NVLS_ENABLE", 20),
        db.Step("seen", f"tar tzf {out}/fake.tar.gz > {{res}}/seen.txt; echo row-line-1; "
                "echo other; echo row-line-2", 20, quote="^row-line"),
        db.Step("fails", "echo boom; echo 'ValueError: bad thing' >&2; exit 3", 20),
        db.Step("hangs", "sleep 60 & echo $! > {res}/sleep.pid; wait", 2),
        db.Step("after", "echo after-ran", 20),
    ))


def _running(pid: int, wait_s: float = 5.0) -> bool:
    """``pid`` is still a live process (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_run_packs_after_every_step_and_kills_a_step_at_its_deadline(tmp_path):
    out = tmp_path / "OUT"
    t0 = time.perf_counter()
    rc = db.run_suite(_fake(tmp_path), out, "abc123", setup="echo setup-ran",
                      stage_root=tmp_path / "stage", scratch_root=tmp_path / "scratch")
    assert rc == 1
    assert time.perf_counter() - t0 < 30  # the 60 s sleep died at its 2 s deadline
    assert sorted(p.name for p in out.iterdir()) == ["fake-summary.md", "fake.tar.gz"]
    with tarfile.open(out / "fake.tar.gz") as tar:
        names = set(tar.getnames())
        read = {n: tar.extractfile(n).read().decode() for n in names if tar.getmember(n).isfile()}
    # the tarball that the second step found was packed after the first
    seen = set(read["fake/results/seen.txt"].split())
    assert {"fake/logs/setup.log", "fake/logs/hello.log", "fake/summary.md"} <= seen
    assert "fake/logs/seen.log" not in {n.rstrip("/") for n in seen}
    assert "hello-from-step" in read["fake/logs/hello.log"] and "abc123 0" in read["fake/logs/hello.log"]
    assert read["fake/logs/after.log"].splitlines() == ["$ echo after-ran", "after-ran"]
    summary = read["fake/summary.md"]
    assert summary == (out / "fake-summary.md").read_text()
    status = dict(re.findall(r"^\| ([\w-]+) \| (\w+) \|", summary, re.M)[1:])
    assert status == {"setup": "ok", "hello": "ok", "seen": "ok", "fails": "failed",
                      "hangs": "timeout", "after": "ok"}
    assert "exit code 3: ValueError: bad thing" in summary and "killed after 2 s" in summary
    assert "    row-line-1\n    row-line-2\n" in summary and "other" not in summary
    assert json.loads(read["fake/provenance.json"])["commit"] == "abc123"
    pid = int((tmp_path / "stage/fake/results/sleep.pid").read_text())
    assert not _running(pid)  # the step's whole process group is gone, its children too


def test_budget_skips_what_no_longer_fits_and_only_selects(tmp_path):
    db.run_suite(_fake(tmp_path), tmp_path / "OUT", "c", setup="true", budget_s=1.0,
                 stage_root=tmp_path / "s", scratch_root=tmp_path / "n")
    summary = (tmp_path / "OUT" / "fake-summary.md").read_text()
    # the hanging step gets what is left of the budget, not its own 2 s; nothing after it runs
    assert re.search(r"^\| hangs \| timeout \| [01] \| 0 \| killed after [01] s \|$", summary, re.M)
    assert "| after | skipped | 0 | 0 | no budget left |" in summary
    db.run_suite(_fake(tmp_path), tmp_path / "O2", "c", setup="true", only={"after"},
                 stage_root=tmp_path / "s2", scratch_root=tmp_path / "n2")
    rows = re.findall(r"^\| ([\w-]+) \| (\w+) \|", (tmp_path / "O2/fake-summary.md").read_text(), re.M)
    assert rows[1:] == [("setup", "ok"), ("after", "ok")]


def test_a_failed_setup_runs_no_step(tmp_path):
    rc = db.run_suite(_fake(tmp_path), tmp_path / "OUT", "c", setup="exit 1",
                      stage_root=tmp_path / "s", scratch_root=tmp_path / "n")
    assert rc == 1
    rows = re.findall(r"^\| ([\w-]+) \| (\w+) \|", (tmp_path / "OUT/fake-summary.md").read_text(), re.M)
    assert rows[1:] == [("setup", "failed")]


def test_log_cap_keeps_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(db, "LOG_CAP_BYTES", 100)
    stage = tmp_path / "stage"
    (stage / "logs").mkdir(parents=True)
    (stage / "logs" / "big.log").write_bytes(b"x" * 1000 + b"THE-END")
    db.pack(stage, tmp_path / "out", "fake", "s\n")
    with tarfile.open(tmp_path / "out" / "fake.tar.gz") as tar:
        data = tar.extractfile("fake/logs/big.log").read()
    assert data.endswith(b"THE-END") and len(data) < 200


def test_running_needs_out():
    with pytest.raises(SystemExit):
        db.main(["gpu-tests"])
