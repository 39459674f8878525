"""A script written the DeepSpeed docs' way (tests/scripts/ds_train.py: ``import deepspeed``,
``add_config_arguments``, ``init_distributed``, ``zero.Init``, ``initialize``,
``GatheredParameters``, save/load_checkpoint) under `zeroio launch`, unchanged.

Reference: the same loop in plain PyTorch, one process on the full batch (data parallelism
averages the ranks' gradients of equal shares, so the mean of the ranks' losses is the
full-batch loss). Two `zeroio launch --num_nodes 2 --node_rank {0,1}` commands on this
machine form one 4-rank world that trains as a 4-rank single-node launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.testing.multirank import free_port, outside_launcher_env

SCRIPT = Path(__file__).parent / "scripts" / "ds_train.py"
REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_AT, BATCH = 6, 3, 8
pytestmark = pytest.mark.slow


def _config(tmp: Path, stage: int) -> Path:
    path = tmp / f"ds{stage}.json"
    path.write_text(json.dumps({
        "train_batch_size": BATCH, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage}}))
    return path


def _start(tmp: Path, flags: list[str], stage: int, tag: str) -> subprocess.Popen:
    # no deepspeed package on the path: zeroio launch puts its facade first (shim_dir())
    env = outside_launcher_env(PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "zeroio.cli.main", "launch", *flags, str(SCRIPT),
           "--deepspeed", "--deepspeed_config", str(_config(tmp, stage)),
           "--save_dir", str(tmp / f"ckpt-{tag}"), "--steps", str(STEPS), "--save_at", str(SAVE_AT)]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(*procs: subprocess.Popen) -> tuple[list[dict], str]:
    rows, err = [], ""
    for proc in procs:
        out, e = proc.communicate(timeout=300)
        err += e
        assert proc.returncode == 0, e[-5000:]
        rows += [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"]), err


def _reference() -> tuple[list[float], float]:
    """Plain PyTorch, one process, full batch: the same net, data and AdamW."""
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 1)
    params = [*fc1.parameters(), *fc2.parameters()]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 6, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(fc2(torch.tanh(fc1(x))), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, sum(float(p.detach().double().sum()) for p in params)


def _check(rows: list[dict], world: int, stage: int) -> None:
    ref_losses, ref_checksum = _reference()
    assert [r["rank"] for r in rows] == list(range(world))
    mean = [sum(r["losses"][i] for r in rows) / world for i in range(STEPS)]
    assert mean == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for r in rows:
        assert r["world_size"] == world and r["steps"] == STEPS
        # the checkpoint resumes: the steps after it train the same again
        assert r["again"] == pytest.approx(r["losses"][SAVE_AT:], rel=1e-6, abs=1e-7)
        assert r["client_state"] == {"step": SAVE_AT}
        assert r["checksum"] == pytest.approx(ref_checksum, rel=1e-5, abs=1e-5)
        # one engine for every route: `import deepspeed` under zeroio launch and the one
        # import line under torchrun give DeepSpeed's engine interface, answering from the run
        assert r["engine"] == {
            "type": "zeroio.deepspeed.engine_adapter.DeepSpeedEngine", "is_ds_engine": True,
            "stage": stage, "local_rank": True,
            "train_batch_size": BATCH, "gas": 1, "boundary": True, "lr": [0.01],
            "has_optimizer": True}


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_script_runs_unchanged_under_zeroio_launch(tmp_path, stage):
    rows, _ = _rows(_start(tmp_path, ["--nproc", "2"], stage, "s"))
    _check(rows, 2, stage)
    # DeepSpeed's launcher passes --local_rank=N to the script
    assert [r["local_rank_arg"] for r in rows] == [0, 1]


def test_include_on_cpu_and_no_local_rank(tmp_path):
    rows, err = _rows(_start(tmp_path, ["--include", "localhost:0,1", "--no_local_rank"],
                             2, "i"))
    _check(rows, 2, 2)
    assert "no CUDA on this machine: slots [0, 1] run as 2 CPU rank(s)" in err
    assert [r["local_rank_arg"] for r in rows] == [-1, -1]  # not passed
    assert [r["args_local_rank"] for r in rows] == [0, 1]  # initialize sets it, as DeepSpeed


def test_two_nodes_on_one_machine_train_as_one_four_rank_world(tmp_path):
    port = free_port()
    nodes = [_start(tmp_path, ["--num_nodes", "2", "--node_rank", str(n), "--nproc", "2",
                                     "--master_addr", "127.0.0.1", "--master_port", str(port)],
                    3, "nodes") for n in (0, 1)]  # one checkpoint of 4 ranks
    multi, _ = _rows(*nodes)
    _check(multi, 4, 3)
    assert sorted(r["local_rank_arg"] for r in multi) == [0, 0, 1, 1]
    single, _ = _rows(_start(tmp_path, ["--nproc", "4"], 3, "one"))
    for a, b in zip(multi, single, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6, abs=1e-7)
        assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-9, abs=1e-9)


def test_one_import_line_runs_it_under_torchrun(tmp_path):
    text = SCRIPT.read_text()
    script = tmp_path / "ds_train_zeroio.py"
    script.write_text(text.replace("import deepspeed\n", "import zeroio.deepspeed as deepspeed\n"))
    changed = [(a, b) for a, b in zip(text.splitlines(), script.read_text().splitlines(),
                                      strict=True) if a != b]
    assert changed == [("import deepspeed", "import zeroio.deepspeed as deepspeed")]
    env = outside_launcher_env(PYTHONPATH=str(REPO))  # no deepspeed package on the path
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(script), "--deepspeed_config",
           str(_config(tmp_path, 3)), "--save_dir", str(tmp_path / "ckpt"), "--steps", str(STEPS),
           "--save_at", str(SAVE_AT)]
    rows, _ = _rows(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True))
    _check(rows, 2, 3)
    assert [r["local_rank_arg"] for r in rows] == [-1, -1]  # torchrun passes none
