"""`zeroio train` and the disk: the pre-flight check, --no-checkpoint and --model-dtype.

A run without checkpoints must write the same weights (cast to bf16) as a run
that checkpoints and is consolidated afterwards; a run whose output folder is
too small must fail before step 1, naming bytes needed (checked against a hand
count) and free. The moments' swap files are gone before the model export, and
the pre-flight counts the larger phase, not the sum.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.testing.train_cli import train_here

pytestmark = pytest.mark.slow
ARGS = ["--steps", "4", "--seq-len", "64", "--micro-batch", "2", "--json"]


def _cmd(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", *ARGS, "--output", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=out.parent)


def _train(out: Path, *extra: str) -> dict:
    proc = _cmd(out, *extra)
    assert proc.returncode == 0, f"{proc.args} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    live = _train(root / "live", "--no-checkpoint", "--model-dtype", "bf16")
    ckpt = _train(root / "ckpt")
    return root, live, ckpt


def test_no_checkpoint_bf16_model_equals_the_consolidated_checkpoint_cast(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from zeroio.checkpoint import consolidate

    root, live, ckpt = runs
    assert live["world_size"] == 2 and live["checkpoint"] is None
    assert not (root / "live" / "checkpoints").exists()
    assert (root / "ckpt" / "checkpoints" / "step4").is_dir()
    # same seed, same steps: the two runs trained identically
    assert live["losses"] == ckpt["losses"]
    model = AutoModelForCausalLM.from_pretrained(live["model_dir"])
    assert isinstance(model, LlamaForCausalLM)
    got = load_file(Path(live["model_dir"]) / "model.safetensors")
    ref = consolidate(root / "ckpt" / "checkpoints", "step4")  # the final fp32 masters
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], w.to(torch.bfloat16)), name
        assert torch.equal(dict(model.named_parameters())[name].detach().to(torch.bfloat16),
                           w.to(torch.bfloat16)), name
    # the checkpointing run's model stays fp32 by default: the masters themselves
    full = load_file(Path(ckpt["model_dir"]) / "model.safetensors")
    assert all(torch.equal(full[n], w) for n, w in ref.items())


def test_preflight_fails_before_step_one_with_needed_and_free(runs, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    from zeroio.cli.main import main
    from zeroio.cli.train.presets import llama_config

    root, live, _ = runs
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    params = sum(p.numel() for p in LlamaForCausalLM(llama_config("tiny")).parameters())
    chunk = (64 << 20) // 4  # fp32 elements per 64 MiB chunk; the last chunk is padded whole
    one_ckpt = 3 * -(-params // chunk) * chunk * 4  # fp32 masters + exp_avg + exp_avg_sq
    model_bytes = (Path(live["model_dir"]) / "model.safetensors").stat().st_size  # raw bf16 file
    # built-in config, 1 rank on CPU: the two moments (8) on NVMe while training (the fp32
    # params have no NVMe home: params_from_master "auto" is on with the NVMe optimizer); the
    # moments' files are deleted before the export (then only the model)
    nvme = 8 * params
    # --save-every 2 of 4 steps: step2 and step4 kept through both phases
    need = 2 * one_ckpt + max(nvme, model_bytes)
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: usage(real(p).total, real(p).used, need - 1))
    out = tmp_path / "run"
    rc = main(["train", *ARGS, "--output", str(out), "--nproc", "1", "--save-every", "2",
               "--model-dtype", "bf16"])
    assert rc == 1
    assert not (out / "checkpoints").exists() and not (out / "model").exists()
    # and the message (printed by main on stderr) names both numbers: run it again to catch it
    from zeroio.cli.train.loop import TrainOptions, train
    from zeroio.errors import CheckpointError

    with pytest.raises(CheckpointError) as e:
        try:
            train(TrainOptions(steps=4, seq_len=64, micro_batch=2, json=True, output=str(out),
                               save_every=2, model_dtype="bf16"))
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    msg = str(e.value)
    assert f"needs {need:,} bytes" in msg and f"{need - 1:,} bytes" in msg, msg
    assert str(out) in msg and "--no-checkpoint" in msg and "--model-dtype bf16" not in msg
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


@pytest.mark.parametrize("extra, clash", [
    (["--resume"], "--resume"),
    (["--save-every", "2"], "--save-every"),
    (["--stop-after", "2"], "--stop-after"),
])
def test_no_checkpoint_conflicts_are_config_errors(tmp_path, extra, clash):
    # refused before any rank starts: the command's own main, in this process
    proc = train_here(tmp_path / "run", [*ARGS, "--no-checkpoint", *extra])
    assert proc.returncode == 2  # a ConfigError: bad arguments, like argparse's
    assert "--no-checkpoint" in proc.stderr and clash in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_moment_swap_files_are_deleted_before_the_export(tmp_path, monkeypatch):
    """The optimizer's swap folder holds the moments while the run trains and is gone when the
    live export starts; the parameters' swap folder stays (the disk plan counts it then)."""
    import zeroio.checkpoint.export16 as export16
    import zeroio.cli.train.loop as loop
    from zeroio.cli.train.loop import TrainOptions, train

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    nvme = out / "nvme"

    def files() -> dict[str, int]:
        return {str(f.relative_to(nvme)): f.stat().st_size for f in nvme.rglob("*") if f.is_file()}

    seen: dict[str, dict[str, int]] = {}
    real_export, real_step = export16.save_16bit_model, loop._one_step

    def export(engine, d, **kw):
        seen["export"] = files()
        return real_export(engine, d, **kw)

    def step(*a, **kw):
        r = real_step(*a, **kw)
        seen["train"] = files()
        return r

    monkeypatch.setattr(export16, "save_16bit_model", export)
    monkeypatch.setattr(loop, "_one_step", step)
    try:
        res = train(TrainOptions(steps=2, seq_len=64, micro_batch=2, json=True, output=str(out),
                                 no_checkpoint=True, model_dtype="bf16"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def optim(snapshot):
        return sum(n for f, n in snapshot.items() if f.startswith("zeroio-optim-"))

    # built-in config at world 1, tiny model: both moments (fp32) of every element on NVMe
    assert optim(seen["train"]) >= 8 * res["params"]
    assert optim(seen["export"]) == 0, seen["export"]
    params_dirs = {f.split("/")[0] for f in seen["export"]}
    assert params_dirs and all(d.startswith("stage3-params-") for d in params_dirs)
    assert (Path(res["model_dir"]) / "model.safetensors").is_file()
    # the stats were taken before the optimizer closed: its store's tiers are in them (its
    # moments fit the host budget and start as zeros, so no byte moved: docs/tiering.md)
    assert res["tier_budgets"]["nvme"] > 0 and res["bytes_moved"] == {}


def test_disk_plan_counts_the_larger_phase(tmp_path):
    """No checkpoints, the built-in config (moments and parameters on NVMe), 1 rank: training
    holds the moments' 8 B/param of swap (params_from_master "auto" is on with the NVMe
    optimizer, so the parameters have no NVMe home), the export the model; the plan needs the
    larger, which here is training's, not their sum."""
    from transformers import LlamaForCausalLM

    from zeroio.cli.train import disk
    from zeroio.cli.train.defaults import default_config
    from zeroio.cli.train.presets import llama_config
    from zeroio.config import load_config

    mcfg = llama_config("tiny")
    params = sum(p.numel() for p in LlamaForCausalLM(mcfg).parameters())
    out = tmp_path / "run"
    cfg = load_config(default_config(out / "nvme", cuda=False), world_size=1,
                      hidden_size=mcfg.hidden_size, per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, learning_rate=1e-3, adam_beta1=0.9,
                      adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
                      bf16=False, fp16=False, num_training_steps=4, warmup_steps=1)
    p = disk.plan(out=out, mcfg=mcfg, cfg=cfg, world_size=1, start=0, end=4, save_every=0,
                  checkpoint=False, write_model=True, model_dtype="bf16", fresh=True)
    model = disk.export_bytes(disk.param_specs(mcfg, torch.bfloat16))
    assert model > 2 * params  # the bf16 weights and a header
    assert p.phase_bytes("train") == 8 * params
    assert p.phase_bytes("export") == model
    assert p.need == 8 * params
    assert "deleted before the model export" in p.breakdown()
    with_ckpt = disk.plan(out=out, mcfg=mcfg, cfg=cfg, world_size=1, start=0, end=4,
                          save_every=0, checkpoint=True, write_model=True, model_dtype="fp32",
                          fresh=True)
    one = disk.training_checkpoint_bytes(params)
    assert with_ckpt.need == one + max(8 * params, disk.export_bytes(
        disk.param_specs(mcfg, torch.float32)))
