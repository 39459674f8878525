"""`zeroio estimate --model-config`: the shape read from a config.json, counted like the real
model, answered without importing torch or transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroio.estimate import estimate_memory, model_shape

SHAPES = [
    dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False),
    dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=4, vocab_size=128, tie_word_embeddings=True),
    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=32, vocab_size=100, tie_word_embeddings=False,
         attention_bias=True, mlp_bias=True),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_matches_the_transformers_model(tmp_path, shape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    unique = {id(p): p for p in model.parameters()}  # tied embeddings count once
    got = model_shape(str(tmp_path))  # the folder
    assert got.num_params == sum(p.numel() for p in unique.values())
    assert got.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert model_shape(str(tmp_path / "config.json")) == got


def _env():
    env = dict(os.environ)
    env.pop("ZEROIO_CPU_ADAM", None)
    return env


def test_cli_reads_the_shape_and_imports_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
         "vocab_size": 32000, "tie_word_embeddings": False}))
    for extra in ([], ["--config", "configs/zero3-nvme.json"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "zeroio.cli.main", "estimate",
             "--model-config", str(tmp_path), "--gpus-per-node", "8", "--json", *extra],
            capture_output=True, text=True, timeout=120, env=_env(),
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported = {ln.split("|")[-1].strip() for ln in proc.stderr.splitlines()
                    if ln.startswith("import time:")}
        assert "zeroio.estimate" in imported
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers",
                                                                   "numpy"))
        assert not heavy, heavy[:10]
        out = json.loads(proc.stdout)
        assert out["num_params"] == 6_738_415_616  # Llama-2-7B's published count
        assert out["model"]["layer_params"] == 202_383_360
        config = None
        if extra:
            from zeroio.config import load_config

            config = load_config("configs/zero3-nvme.json")
        ref = estimate_memory(6_738_415_616, 8, 1, config=config, largest_group=202_383_360)
        assert {k: v for k, v in out.items() if k != "model"} == ref.to_dict()


def test_cli_model_config_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "zeroio.cli.main", "estimate", *args],
                              capture_output=True, text=True, timeout=120)

    bad = run("--model-config", str(tmp_path))
    assert bad.returncode == 2 and "num_attention_heads" in bad.stderr, bad.stderr
    missing = run("--model-config", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    both = run("--model-config", str(tmp_path), "--params", "1B")
    assert both.returncode == 2 and "not allowed with" in both.stderr
