"""`zeroio train --resume --tag TAG`: continue from a chosen checkpoint, e.g. past a corrupt newest one.

A run checkpoints step2 and step4; a byte of step4's fp32 masters is then
flipped. Plain --resume picks step4 and fails on its checksum; --tag step2
resumes from step2 and retraces the original run's losses for steps 3 and 4;
a tag that does not exist is an error listing the ones there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroio.testing.train_cli import train_here

pytestmark = pytest.mark.slow
ARGS = ["--steps", "4", "--seq-len", "64", "--micro-batch", "2", "--json", "--nproc", "1"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROIO_RUN_LOCK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", *ARGS, "--output", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tag") / "run"
    first = _train(out, "--save-every", "2")
    assert first.returncode == 0, first.stderr[-4000:]
    chunk = out / "checkpoints" / "step4" / "fp32" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF  # a flipped bit of the newest checkpoint's masters
    chunk.write_bytes(bytes(data))
    res = {"first": json.loads(first.stdout.strip().splitlines()[-1])}
    res["newest"] = _train(out, "--resume")
    # refused before any rank starts: the command's own main, in this process
    res["missing"] = train_here(out, [*ARGS, "--resume", "--tag", "step3"])
    res["no_resume"] = train_here(out, [*ARGS, "--tag", "step2"])
    res["tag"] = _train(out, "--resume", "--tag", "step2")
    return out, res


def test_resume_from_a_chosen_tag_retraces_the_original_run(runs):
    _, res = runs
    assert res["newest"].returncode == 1  # the corrupt newest checkpoint is not trained on
    proc = res["tag"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["start_step"] == 2 and resumed["end_step"] == 4
    assert resumed["losses"] == res["first"]["losses"]  # steps 1-2 restored, 3-4 retrained alike


def test_a_missing_tag_lists_the_available_ones(runs):
    out, res = runs
    proc = res["missing"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step3" in proc.stderr and "step2" in proc.stderr and "step4" in proc.stderr, proc.stderr
    assert str(out / "checkpoints") in proc.stderr and "Traceback" not in proc.stderr
    proc = res["no_resume"]
    assert proc.returncode == 2 and "--resume" in proc.stderr, proc.stderr[-3000:]
