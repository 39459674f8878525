"""accelerate's config-file route on zeroio: ``zeroio launch --config_file CFG.yaml SCRIPT``
([Note: accelerate config files under zeroio launch] in zeroio/cli/launch_accelerate.py), and
``accelerate launch --num_processes 2`` without a config refused instead of training one rank.

tests/scripts/accelerate_plain.py is a loop written the way accelerate's docs write one
(``Accelerator()``, ``prepare``, ``accelerator.backward``). Two accelerate configs with
``distributed_type: DEEPSPEED``, one naming a DeepSpeed JSON (``deepspeed_config_file``,
stage 3), one inline (``zero_stage: 2`` with the optimizer offloaded), each on 2 CPU
processes; reference: plain PyTorch AdamW on the global batch (accelerate gives process r
batches r, r + 2, ..., so step s covers samples [8 s, 8 s + 8)), clipped at norm 1.0 where
accelerate sets that (an inline config).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.errors import ConfigError
from zeroio.testing.multirank import free_port, outside_launcher_env

pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[1]


def _reference(clip: float | None = None) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    losses = []
    for s in range(8):
        loss = torch.nn.functional.mse_loss(net(x[8 * s:8 * s + 8]), y[8 * s:8 * s + 8])
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses,
            "weights": {n: p.detach().double().reshape(-1).tolist()
                        for n, p in net.named_parameters()}}


_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
{deepspeed}
num_machines: 1
num_processes: 2
main_process_port: {port}
use_cpu: false
"""


def _launch(tmp: Path, deepspeed: str) -> subprocess.CompletedProcess:
    cfg = tmp / "accelerate.yaml"
    cfg.write_text(_YAML.format(deepspeed=deepspeed, port=free_port()))
    env = outside_launcher_env(PYTHONPATH=str(REPO), HF_HOME=str(tmp / "hf"))
    cmd = [sys.executable, "-m", "zeroio.cli.main", "launch", "--config_file", str(cfg),
           str(SCRIPTS / "accelerate_plain.py"), "--out", str(tmp)]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def _check(tmp: Path, proc: subprocess.CompletedProcess, clip: float | None = None) -> None:
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads((tmp / "result.json").read_text())
    ref = _reference(clip)
    assert out["processes"] == 2 and out["model"] == "DeepSpeedEngine"
    assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for name, values in ref["weights"].items():
        assert out["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-7), name


@pytest.mark.slow
def test_deepspeed_config_file_named_in_the_accelerate_config(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 1,
                              "zero_optimization": {
                                  "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}))
    _check(tmp_path, _launch(tmp_path, f"  deepspeed_config_file: {ds}\n  zero3_init_flag: false"))


@pytest.mark.slow
def test_inline_zero_stage_with_the_optimizer_offloaded(tmp_path):
    inline = ("  zero_stage: 2\n  gradient_accumulation_steps: 1\n"
              "  offload_optimizer_device: cpu\n  offload_param_device: none\n"
              "  zero3_init_flag: false\nmixed_precision: 'no'")
    # accelerate fills an inline config's gradient_clipping with 1.0 (Accelerator.prepare)
    _check(tmp_path, _launch(tmp_path, inline), clip=1.0)


def test_node_flags_become_accelerates():
    from zeroio.cli.launch_accelerate import accelerate_argv

    args = argparse.Namespace(config_file="c.yaml", nproc=4, nnodes=2, node_rank=1,
                              master_addr="10.0.0.1", master_port=29501, module=False,
                              no_python=False, hostfile=None, include="", exclude="",
                              bind_cores_to_rank=False, bind_core_list=None, script="train.py")
    assert accelerate_argv(args, ["--lr", "1"])[1:] == [
        "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "--num_processes", "8",
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
        "--main_process_port", "29501", "train.py", "--lr", "1"]
    args.include = "localhost:0,1"
    with pytest.raises(ConfigError, match="--include with --config_file"):
        accelerate_argv(args, [])


@pytest.mark.slow
def test_accelerate_launch_without_a_config_is_refused_not_run_on_one_rank(tmp_path):
    """``accelerate launch --num_processes 2`` with no config starts one process; the facade's
    ``init_distributed`` says so instead of training that one rank as the world."""
    from zeroio.deepspeed import shim_dir

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                               "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}))
    env = outside_launcher_env(PYTHONPATH=f"{shim_dir()}:{REPO}", HF_HOME=str(tmp_path / "hf"))
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "2",
           str(SCRIPTS / "ds_train.py"), "--deepspeed_config", str(cfg), "--save_dir",
           str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "accelerate launch was asked for 2 processes but started 1" in proc.stderr
    assert "zeroio launch --nproc 2" in proc.stderr


def test_the_requested_count_is_read_from_either_spelling_of_accelerate_launch():
    from zeroio.config.accelerate_launch import fewer_than_asked

    env = {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1"}
    for argv in (["/venv/bin/accelerate", "launch", "--num_processes", "2", "t.py"],
                 ["python", "-m", "accelerate.commands.launch", "--num_processes=2", "t.py"]):
        assert fewer_than_asked(env, argv) == (2, 1)
        assert fewer_than_asked({**env, "WORLD_SIZE": "2"}, argv) is None
