"""What the ``deepspeed`` facade says about the engine that runs ([Note: the start-up banner],
[Note: a DeepSpeed installation beside the import line] in zeroio/deepspeed/banner.py).

References: the config given (stage, offload devices, NVMe path), the placement zeroio's
docs define for it (where each buffer kind is homed), DeepSpeed's logger convention (a level
above INFO silences it), and a DeepSpeed distribution laid out as pip installs one.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
import sys

import pytest

from zeroio.testing import run_ranks
from zeroio.testing.hf_scripts import REPO
from zeroio.testing.multirank import outside_launcher_env


def _banner(nvme: str) -> str:
    import torch

    import zeroio.deepspeed as deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "nvme", "nvme_path": nvme}}}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        deepspeed.initialize(model=model, config=config)
    return out.getvalue()


def test_rank0_banner_names_engine_stage_offload_and_placement(tmp_path):
    import torch

    from zeroio import __version__

    (text,) = run_ranks(_banner, 1, str(tmp_path))
    lines = [ln for ln in text.splitlines() if ln.startswith("[zeroio]")]
    assert len(lines) == 1
    head, stage, offload, placement = lines[0].split(" | ")
    assert head == f"[zeroio] zeroio {__version__} (DeepSpeed 0.18.0 API)"
    assert stage == "ZeRO stage 3, 1 rank(s), fp32"
    assert offload == f"offload optimizer cpu, params nvme ({tmp_path})"
    # stage 3, offload_param nvme, offload_optimizer cpu: the fp32 masters, Adam moments and
    # gradient shard in host memory; the 16-bit shards too, since this model's are far below
    # offload_param.max_in_cpu (DeepSpeed's default 1e9 elements kept in host memory)
    # on a machine without a GPU the compute tier is named for what it is
    compute = "gpu" if torch.cuda.is_available() else "compute(cpu)"
    assert placement.startswith("placement: 16-bit params cpu, masters cpu, moments cpu, "
                                f"gradients cpu; per rank {compute} "), placement


def test_banner_is_silenced_like_deepspeeds_output(monkeypatch):
    from zeroio.deepspeed.banner import silenced

    ds = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(ds, "level", logging.NOTSET)
    monkeypatch.delenv("ZEROIO_BANNER", raising=False)
    hf = sys.modules.get("transformers.utils.logging")
    if hf is not None:
        monkeypatch.setattr(hf, "get_verbosity", lambda: logging.WARNING)
    assert not silenced()  # DeepSpeed's default: INFO
    monkeypatch.setattr(ds, "level", logging.WARNING)  # Lightning's logging_level default
    assert silenced()
    monkeypatch.setattr(ds, "level", logging.INFO)
    monkeypatch.setenv("ZEROIO_BANNER", "0")
    assert silenced()
    monkeypatch.setenv("ZEROIO_BANNER", "1")
    assert not silenced()


def test_trainer_log_level_error_silences_it():
    code = ("import logging, transformers\n"
            "from zeroio.deepspeed.banner import silenced\n"
            "a = silenced()\n"
            "transformers.logging.set_verbosity_error()\n"  # TrainingArguments(log_level='error')
            "print(a, silenced())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=outside_launcher_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"]


@pytest.fixture()
def real_deepspeed(tmp_path):
    """A DeepSpeed distribution as pip lays one out: the package and its dist-info."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text('__version__ = "0.16.4"\nREAL = True\n')
    info = site / "deepspeed-0.16.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.16.4\n")
    (info / "RECORD").write_text("")
    return site


@pytest.mark.parametrize("rank", [None, "1"])
def test_one_import_line_beside_real_deepspeed_warns_on_rank0(real_deepspeed, rank):
    code = ("import json, zeroio.deepspeed\n"
            "import deepspeed\n"
            "print(json.dumps({'real': getattr(deepspeed, 'REAL', False)}))\n")
    env = outside_launcher_env(PYTHONPATH=f"{REPO}:{real_deepspeed}")
    if rank is not None:
        env.update(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"real": True}  # left in place
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("[zeroio] WARNING")]
    if rank == "1":
        assert warnings == []
        return
    assert len(warnings) == 1
    assert "DeepSpeed 0.16.4 is installed" in warnings[0]
    assert str(real_deepspeed) in warnings[0] and "zeroio launch" in warnings[0]
