"""A stock Trainer script launched on 2 CPU ranks without ``--use_cpu`` trains on 2 ranks.

On a machine with no GPU, transformers' TrainingArguments without ``use_cpu``
makes each rank a world of its own; zeroio's engine then refused the config
("resolved for world_size 1 but 2 ranks are running"). zeroio's
TrainingArguments train on CPU there, as ``--use_cpu`` would. Reference: the
Trainer's own epoch count, by hand: 2 steps x micro batch 4 x accumulation 2 x
2 ranks = 32 of 64 blocks = epoch 0.5 (one rank alone would log 0.25).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_trainer_on_two_cpu_ranks_without_use_cpu(tmp_path):
    from test_hf_dropin import (
        DEEPSPEED_IMPORT,
        DEEPSPEED_SCRIPT,
        SEED_ZERO2,
        ZEROIO_IMPORT,
        _blocks,
        _env,
        _script_args,
        _tiny_pretrained,
    )

    _tiny_pretrained(tmp_path / "pretrained")
    _blocks(tmp_path / "blocks.json", n=64)
    (tmp_path / "ds_config_zero2.json").write_text(json.dumps(SEED_ZERO2))
    (tmp_path / "train.py").write_text(DEEPSPEED_SCRIPT.replace(DEEPSPEED_IMPORT, ZEROIO_IMPORT))
    args = [a for a in _script_args(tmp_path, tmp_path / "out") if a != "--use_cpu"]
    args[args.index("--max_steps") + 1] = "2"
    args[args.index("--logging_steps") + 1] = "1"
    proc = subprocess.run([sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2",
                           str(tmp_path / "train.py"), *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    logs = [ast.literal_eval(ln) for ln in proc.stdout.splitlines() if ln.startswith("{'loss'")]
    assert [float(r["epoch"]) for r in logs] == [0.25, 0.5]
    assert (tmp_path / "out" / "final").is_dir()
