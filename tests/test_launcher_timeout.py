"""A stopped rank (SIGSTOP) is reported after distributed.timeout_s, by rank, not after 600 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from zeroio.testing.multirank import outside_launcher_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals")

TIMEOUT_S = 4

SCRIPT = textwrap.dedent(f"""
    import json, os, signal, sys, time
    from pathlib import Path
    import torch
    import zeroio
    from zeroio.errors import DistributedError

    out = Path(sys.argv[-1])  # zeroio launch passes --local_rank=N first
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
              "zero_optimization": {{"stage": 2}}, "distributed": {{"timeout_s": {TIMEOUT_S}}}}}
    engine, *_ = zeroio.initialize(model=model, config=config)

    def step():
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    step()
    if engine.global_rank == 1:
        (out / "stopped.1").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            step()
        result = {{"error": None}}
    except DistributedError as e:
        result = {{"error": str(e), "waited": time.monotonic() - t0}}
    (out / f"result.{{engine.global_rank}}.tmp").write_text(json.dumps(result))
    os.replace(out / f"result.{{engine.global_rank}}.tmp", out / f"result.{{engine.global_rank}}")
    sys.exit(1 if result["error"] else 0)
""")


def test_a_stopped_rank_is_named_after_the_configured_timeout(tmp_path):
    script = tmp_path / "stop.py"
    script.write_text(SCRIPT)
    env = outside_launcher_env()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", str(script),
         str(tmp_path)], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = tmp_path / "result.0"
    try:
        deadline = time.monotonic() + 150
        while not result.exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        assert result.exists(), "rank 0 did not report within 150 s"
        r = json.loads(result.read_text())
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # the stopped rank dies with it
        launcher.wait(timeout=30)
    assert (tmp_path / "stopped.1").exists()
    assert r["error"] is not None, "rank 0 trained on without its peer"
    assert "rank 1 stopped answering" in r["error"], r["error"]
    assert "on rank 0" in r["error"] and "distributed.timeout_s" in r["error"]
    # the configured wait plus the peer check (5 s), far from the 600 s default
    assert TIMEOUT_S - 1 <= r["waited"] < TIMEOUT_S + 20, r
