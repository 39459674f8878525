"""benchmarks/bench_train.py: result JSON goes to --out, child progress streams on stderr.

Runs the real `zeroio train` (tiny preset, a few steps, CPU) through the
script; the losses recorded must be the child's own summary (first/last
equal to the ends of its loss list) and one progress line per step must
have reached the script's stderr while stdout kept only the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_out_folder_and_streamed_progress(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, ZEROIO_COMMIT="feedbeef")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--preset", "tiny",
         "--nprocs", "1", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
         "--progress-every", "1", "--timeout", "240", "--output", str(tmp_path / "run"),
         "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.glob("train-tiny-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["commit"] == "feedbeef"
    run = doc["runs"][0]
    assert run["ok"] and run["nproc"] == 1 and len(run["losses"]) == 3
    assert run["first_loss"] == run["losses"][0] and run["last_loss"] == run["losses"][-1]
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in progress] == ["1/3", "2/3", "3/3"]
    assert f"{run['losses'][-1]:.4f}" in progress[-1]
    assert "step 1/3" not in proc.stdout
    assert not (REPO / "benchmarks" / "results" / files[0].name).exists()


def test_timeout_is_a_failed_run_not_a_hang(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--preset", "tiny",
         "--nprocs", "1", "--steps", "500", "--seq-len", "32", "--micro-batch", "2",
         "--timeout", "3", "--output", str(tmp_path / "run"), "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    doc = json.loads(next(tmp_path.glob("train-tiny-*.json")).read_text())
    assert doc["runs"][0]["ok"] is False
    assert doc["runs"][0]["error"] == "timed out after 3 s"
