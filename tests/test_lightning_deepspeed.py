"""PyTorch Lightning's DeepSpeed strategy on zeroio.

tests/scripts/lightning_train.py is a Lightning script written the way Lightning's docs write
a DeepSpeed run (LightningModule with ``configure_model``, ``L.Trainer(strategy=...,
accelerator="gpu", devices=1, precision="bf16-mixed")``, fit, ``save_checkpoint``, fit again
from ``ckpt_path``). Lightning refuses DeepSpeed on a CPU, so:

- CPU, in a fresh interpreter: every DeepSpeed strategy (the named ones and
  ``DeepSpeedStrategy(config=...)``) is built by ``L.Trainer`` with the facade active, and
  ``fit`` gets as far as Lightning's own CUDA check; the engine methods Lightning calls take
  the arguments Lightning passes.
- CPU, 2 gloo ranks: the same script with Lightning's two CUDA checks lifted
  (tests/scripts/lightning_cpu.py), at stage 3 by name under ``zeroio launch`` and at stage 2
  from a config file under ``torchrun`` with the one import line; every step's loss of the
  first fit and of the resumed fit, the learning rate and the weights equal plain PyTorch
  (AdamW and StepLR on the global batch).
- GPU (``@pytest.mark.gpu``): the script as written, one GPU, bf16-mixed, stage 2, stage 3
  and a config file: the run resumes where it stopped (steps, learning rate) and its losses
  follow plain PyTorch's within bf16's precision.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.testing.cuda import need_cuda
from zeroio.testing.multirank import free_port, outside_launcher_env, path_first

# found, not imported: importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK in this process's
# environment for good, and every later multi-rank test would then spawn its ranks
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="lightning is not installed")

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[1]
LR, FIRST_EPOCHS, ALL_EPOCHS, SAMPLES = 1e-2, 2, 3, 64

_BUILD = """
import inspect, json
import zeroio.deepspeed  # the one import line
import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from deepspeed import DeepSpeedEngine

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

out = {}
config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
for name, strategy in (("stage_2", "deepspeed_stage_2"), ("stage_3", "deepspeed_stage_3"),
                       ("config", DeepSpeedStrategy(config=config))):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1,
                        logger=False, enable_checkpointing=False)
    s = trainer.strategy
    row = {"class": type(s).__name__, "stage": s.config["zero_optimization"]["stage"]}
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
    try:
        trainer.fit(Tiny(), loader)
    except RuntimeError as e:
        row["fit"] = str(e)
    out[name] = row
sig = inspect.signature
out["save"] = str(sig(DeepSpeedEngine.save_checkpoint).bind(
    None, "dir", client_state={}, tag="checkpoint", exclude_frozen_parameters=False).arguments)
out["load"] = str(sig(DeepSpeedEngine.load_checkpoint).bind(
    None, "dir", load_optimizer_states=True, load_lr_scheduler_states=False,
    load_module_strict=True).arguments)
out["settable_scheduler"] = DeepSpeedEngine.lr_scheduler.fset is not None
print(json.dumps(out))
"""


def test_lightning_builds_every_deepspeed_strategy_on_the_facade():
    proc = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True,
                          timeout=300, env=outside_launcher_env(PYTHONPATH=path_first(str(REPO))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, stage in (("stage_2", 2), ("stage_3", 3), ("config", 3)):
        assert out[name]["class"] == "DeepSpeedStrategy" and out[name]["stage"] == stage
        # past the facade (logger, init, checkpointing imports): Lightning's own CPU refusal
        assert "only supported on CUDA GPUs" in out[name]["fit"], out[name]
    assert "client_state" in out["save"] and "load_module_strict" in out["load"]
    assert out["settable_scheduler"]


def _reference(world: int, batch: int = 8) -> dict:
    """Plain PyTorch: the same net and data, AdamW and StepLR(3, 0.5) stepped every step, one
    process on the global batch: step s of epoch e takes, from each rank's share of torch's
    DistributedSampler (what Lightning puts on a training loader: shuffled, seed 0,
    ``set_epoch(e)``), its s-th batch of ``batch`` samples."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.TensorDataset(x, y)
    per_epoch = SAMPLES // (batch * world)
    losses = []
    for epoch in range(ALL_EPOCHS):
        shares = []
        for rank in range(world):
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank,
                                                          shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        for s in range(per_epoch):
            idx = [i for share in shares for i in share[s * batch:(s + 1) * batch]]
            loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    weights = {f"net.{n}": p.detach().double().reshape(-1).tolist()
               for n, p in net.named_parameters()}
    return {"losses": losses, "lr": sched.get_last_lr(), "weights": weights,
            "per_epoch": per_epoch}


def _check(out: dict, ref: dict, rel: float, weights: bool = True) -> None:
    """Steps continued after the resume, the learning rate, every loss within ``rel`` and (fp32
    runs) the weights; a bf16 run's weights are held through its losses only (Adam's
    normalised steps move a weight whose gradient is near 0 by up to the learning rate either
    way, whatever the precision)."""
    first = FIRST_EPOCHS * ref["per_epoch"]
    assert out["first_steps"] == first
    assert out["resumed_steps"] == ALL_EPOCHS * ref["per_epoch"]  # continued, not restarted
    assert out["first"] == pytest.approx(ref["losses"][:first], rel=rel)
    assert out["resumed"] == pytest.approx(ref["losses"][first:], rel=rel)
    assert out["lr"] == pytest.approx(ref["lr"], rel=1e-6)  # the schedule came back too
    for name, values in ref["weights"].items() if weights else ():
        assert out["weights"][name] == pytest.approx(values, rel=rel, abs=rel * 1e-2), name


def _run(cmd: list[str], tmp: Path) -> dict:
    proc = subprocess.run(cmd, cwd=tmp, env=outside_launcher_env(PYTHONPATH=path_first(str(REPO))),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # Lightning sets the DeepSpeed logger to WARNING: zeroio's banner is silenced with it
    assert "[zeroio] zeroio" not in proc.stdout
    return json.loads((tmp / "losses.json").read_text())


def _script_args(tmp: Path, strategy: str, accelerator: str, devices: int, precision: str):
    return ["--strategy", strategy, "--accelerator", accelerator, "--devices", str(devices),
            "--precision", precision, "--out", str(tmp)]


@pytest.mark.slow
def test_stage3_by_name_trains_checkpoints_resumes_under_zeroio_launch(tmp_path):
    cmd = [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", "--no_local_rank",
           "--master_port", str(free_port()), str(SCRIPTS / "lightning_cpu.py"),
           str(SCRIPTS / "lightning_train.py"),
           *_script_args(tmp_path, "deepspeed_stage_3", "cpu", 2, "32-true")]
    out = _run(cmd, tmp_path)
    assert out["stage"] == 3
    _check(out, _reference(2), rel=1e-5)


@pytest.mark.slow
def test_config_file_with_one_import_line_under_torchrun(tmp_path):
    script = tmp_path / "lightning_train_one_import.py"
    script.write_text("import zeroio.deepspeed  # noqa: F401\n"
                      + (SCRIPTS / "lightning_train.py").read_text())
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2,
                                                        "offload_optimizer": {"device": "cpu"}}}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(SCRIPTS / "lightning_cpu.py"), str(script),
           *_script_args(tmp_path, str(config), "cpu", 2, "32-true")]
    out = _run(cmd, tmp_path)
    assert out["stage"] == 2
    _check(out, _reference(2), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3", "config"])
def test_lightning_script_as_written_on_one_gpu(tmp_path, strategy):
    need_cuda(1)
    if strategy == "config":
        strategy = str(tmp_path / "ds.json")
        Path(strategy).write_text(json.dumps({"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"}}}))
    cmd = [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "1", "--no_local_rank",
           str(SCRIPTS / "lightning_train.py"),
           *_script_args(tmp_path, strategy, "gpu", 1, "bf16-mixed")]
    out = _run(cmd, tmp_path)
    _check(out, _reference(1), rel=5e-2, weights=False)
