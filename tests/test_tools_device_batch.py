"""tools/device_batch.py: batches fit the device tool's limits; a run packs what finished.

Batch sizes are checked against the tool's own limits (600 s per command,
2,000 characters, 8 carried paths), the GPU test list against the files that
carry ``pytest.mark.gpu``, and a run of a made-up batch (a passing step, a
failing one, one killed at its deadline, one writing a train_peers-style
result) against the tarball's members and the summary it writes.
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

import device_batch as db  # noqa: E402

REQUIRED = {"gpu1-tests", "gpu2-tests", "peers-zeroio", "peers-others", "train-1b", "probe"}


def test_required_batches_exist_and_fit_one_run_call():
    assert REQUIRED <= set(db.BY_NAME)
    for b in db.BATCHES:
        assert b.total_s <= 540, (b.name, b.total_s)
        assert all(s.timeout_s > 0 for s in b.steps)
        params = db.run_params(b, "0" * 40, "--probe-layers 32" if b.name == "probe" else "")
        assert len(params["command"]) <= 2000
        assert len(params["carry"]) <= 8
        assert params["timeout_s"] <= 600
        assert params["kind"] in ("nvidia-h200", "nvidia-h200-x2")
        assert f"ZEROIO_COMMIT={'0' * 40} " in params["command"]
        # expanded step commands are what the device runs; none may depend on .git
        for s in b.steps:
            cmd = db.expand(s, Path("/r"), Path("/n"), Path("/l"), 32)
            assert "{" not in cmd and "git " not in cmd, cmd


def test_step_timeouts_leave_room_inside_the_contenders_own():
    """A train_peers/bench_train step's own --timeout is below the batch step's deadline, so the
    script gets to write its JSON row (timeout row) before the batch kills it."""
    for b in db.BATCHES:
        for s in b.steps:
            m = re.search(r"--timeout (\d+)", s.shell)
            if m:
                assert int(m.group(1)) < s.timeout_s, (b.name, s.name)


def test_gpu_test_files_are_all_in_a_batch():
    """Every file with -m gpu tests is run by a one-GPU test batch (gpu1-tests, gpu1-tests-b)."""
    marked = {p.name for p in (REPO / "tests").glob("test_*.py")
              if re.search(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)", p.read_text(), re.M)}
    covered = {Path(m).name for b in db.BATCHES if b.name.startswith("gpu1-tests")
               for s in b.steps for m in re.findall(r"tests/(test_\w+\.py)", s.shell)}
    assert marked and marked <= covered, marked - covered


def test_two_gpu_batch_runs_the_nccl_tests_and_two_rank_train():
    shells = " ".join(s.shell for s in db.BY_NAME["gpu2-tests"].steps)
    assert "test_matches_single_process_adamw_nccl" in shells
    assert "test_stage3_two_gpus_nccl" in shells
    assert "--nprocs 2" in shells and "--preset 1b" in shells
    assert db.BY_NAME["gpu2-tests"].kind is db.Kind.H200_X2


def test_peers_batches_carry_peers_and_cover_every_contender():
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
    contenders = importlib.import_module("contenders")
    run = set()
    for b in db.BATCHES:
        for s in b.steps:
            m = re.search(r"--only (\S+)", s.shell)
            if m:
                names = set(m.group(1).split(","))
                run |= names
                if any(n.startswith("ds-") for n in names):
                    assert b.peers and ".peers" in b.carry and "--libaio-dir" in s.shell
    assert run == set(contenders.BY_NAME)


def test_dry_run_and_print_run(capsys):
    assert db.main(["peers-zeroio", "--dry-run"]) == 0
    text = capsys.readouterr().out
    total = int(re.search(r"total (\d+) s", text).group(1))
    assert total == db.BY_NAME["peers-zeroio"].total_s <= 540
    assert db.main(["probe", "--print-run", "--probe-layers", "32"]) == 0
    params = json.loads(capsys.readouterr().out)
    assert params["command"].endswith("--out $OUT --probe-layers 32")
    assert params["carry"] == [".whl"]


def _fake_batch() -> db.Batch:
    row = {"kind": "train_peers", "rows": [{"name": "plain", "world": 1, "status": "ok",
                                            "s_per_step": 0.25, "tokens_per_s": 32768.0,
                                            "peak_gpu_gib": 44.4, "reason": ""}],
           "disk": None, "disk_bound_s_per_step": {}}
    return db.Batch(name="fake", kind=db.Kind.H200, what="test", steps=(
        db.Step(name="hello", shell="echo hello-from-step; echo $ZEROIO_COMMIT $NCCL_NVLS_ENABLE",
                timeout_s=20, sized=""),
        db.Step(name="writes", shell="echo '" + json.dumps(row).replace("{", "{{").replace("}", "}}")
                + "' > {res}/peers-x.json",
                timeout_s=20, sized=""),
        db.Step(name="fails", shell="echo boom; echo 'ValueError: bad thing' >&2; exit 3",
                timeout_s=20, sized=""),
        db.Step(name="hangs", shell="sleep 60", timeout_s=2, sized=""),
        db.Step(name="after", shell="echo after", timeout_s=20, sized=""),
    ))


def test_run_batch_streams_and_packs_every_result(tmp_path, capsys):
    out = tmp_path / "OUT"
    t0 = time.perf_counter()
    rc = db.run_batch(_fake_batch(), out, "abc123", None, stage_root=tmp_path / "stage",
                      nvme_root=tmp_path / "nvme", setup="echo setup-ran")
    wall = time.perf_counter() - t0
    assert rc == 1
    assert wall < 30  # the hanging step was killed at its 2 s deadline, not after 60 s
    printed = capsys.readouterr().out
    assert "hello-from-step" in printed and "abc123 0" in printed
    assert sorted(p.name for p in out.iterdir()) == ["fake-summary.md", "fake.tar.gz"]
    with tarfile.open(out / "fake.tar.gz") as tar:
        names = set(tar.getnames())
        summary = tar.extractfile("fake/summary.md").read().decode()
        hello = tar.extractfile("fake/logs/hello.log").read().decode()
    assert {"fake/results/peers-x.json", "fake/provenance.json", "fake/logs/setup.log",
            "fake/logs/hangs.log"} <= names
    assert "hello-from-step" in hello
    assert summary == (out / "fake-summary.md").read_text()
    status = dict(re.findall(r"^\| (\w+) \| (\w+) \|", summary, re.M)[1:])
    assert status == {"setup": "ok", "hello": "ok", "writes": "ok", "fails": "failed",
                      "hangs": "timeout", "after": "ok"}
    assert "ValueError: bad thing" in summary
    assert "plain x1: ok 0.250 s/step 32,768 tok/s peak GPU 44.4 GiB" in summary


def test_budget_skips_steps_that_no_longer_fit(tmp_path):
    out = tmp_path / "OUT"
    db.run_batch(_fake_batch(), out, "c", None, stage_root=tmp_path / "s",
                 nvme_root=tmp_path / "n", setup="true", budget_s=1.0)
    summary = (out / "fake-summary.md").read_text()
    assert "| after | skipped |" in summary


def test_log_cap_keeps_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(db, "LOG_CAP_BYTES", 100)
    stage = tmp_path / "stage"
    (stage / "logs").mkdir(parents=True)
    (stage / "logs" / "big.log").write_bytes(b"x" * 1000 + b"THE-END")
    db.pack(stage, tmp_path / "out", _fake_batch(), "s\n")
    with tarfile.open(tmp_path / "out" / "fake.tar.gz") as tar:
        data = tar.extractfile("fake/logs/big.log").read()
    assert data.endswith(b"THE-END") and len(data) < 200


@pytest.mark.parametrize("missing", ["--out"])
def test_running_needs_out(missing, capsys):
    with pytest.raises(SystemExit):
        db.main(["gpu1-tests"])
