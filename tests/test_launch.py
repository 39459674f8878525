"""`zeroio launch`, plain `torchrun` and `accelerate launch` each run a 2-rank zeroio.initialize script.

Every launcher must produce the same training as a single-process PyTorch
reference: AdamW on the mean of the two ranks' losses (data parallelism).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.cli.launch_cmd import torchrun_argv
from zeroio.errors import ConfigError
from zeroio.testing.multirank import free_port

SCRIPT = Path(__file__).with_name("launch_script_zeroio.py")
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd: list[str], cwd: Path) -> list[dict]:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def _reference(steps: int = 5):
    """Single-process PyTorch: per-rank losses and the final parameter checksum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    data = []
    for rank in range(2):
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(4, 8, generator=g)
        data.append((x, x.sum(dim=1, keepdim=True)))
    losses = [[], []]
    for _ in range(steps):
        opt.zero_grad()
        per_rank = [torch.nn.functional.mse_loss(model(x), y) for x, y in data]
        for r, loss in enumerate(per_rank):
            losses[r].append(loss.item())
        (sum(per_rank) / 2).backward()
        opt.step()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return losses, checksum


def _check(rows: list[dict]) -> None:
    ref_losses, ref_checksum = _reference()
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["world_size"] == 2 and r["steps"] == 5
        assert r["losses"] == pytest.approx(ref_losses[r["rank"]], rel=1e-4, abs=1e-5)
        assert r["checksum"] == pytest.approx(ref_checksum, rel=1e-4, abs=1e-4)
    assert rows[0]["losses"][-1] < rows[0]["losses"][0]


def test_zeroio_launch_runs_two_ranks(tmp_path):
    _check(_run([sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", str(SCRIPT)],
                tmp_path))


def test_plain_torchrun_runs_two_ranks(tmp_path):
    _check(_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                 f"--master-port={free_port()}", str(SCRIPT)], tmp_path))


def test_accelerate_launch_runs_two_ranks(tmp_path):
    accelerate = Path(sys.executable).with_name("accelerate")
    if not accelerate.exists():
        pytest.skip(f"the accelerate command is not installed next to {sys.executable}")
    # --multi_gpu selects accelerate's torch.distributed.run launcher; without CUDA it runs gloo on CPU
    _check(_run([str(accelerate), "launch", "--multi_gpu", "--num_processes", "2",
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_port", str(free_port()), str(SCRIPT), "accelerate"], tmp_path))


def test_zeroio_launch_reports_a_failing_rank(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = subprocess.run([sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2",
                           str(bad)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr


def test_torchrun_argv_translation_and_validation():
    argv = torchrun_argv("train.py", ["--lr", "1"], nproc=4, nnodes=2, node_rank=1,
                         master_addr="10.0.0.1", master_port=1234)
    assert argv == ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
                    "--master-port=1234", "train.py", "--lr", "1"]
    multi = torchrun_argv("t.py", [], nproc=1, nnodes=2)
    assert "--master-port=29500" in multi  # nodes must agree: no random port
    with pytest.raises(ConfigError, match="--node-rank 2"):
        torchrun_argv("t.py", [], nproc=1, nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="--nproc"):
        torchrun_argv("t.py", [], nproc=0)
