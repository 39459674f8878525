"""An export into a folder that holds an earlier one replaces it whole: `from_pretrained` loads
the new weights (sharded over single-file and the reverse), the user's other files stay, and
a failed export leaves the earlier one as it was. The same for `zeroio consolidate`,
`write_folder` (engine.save_16bit_model's writer) and the standalone recover.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zeroio.checkpoint import (
    SaveOptions,
    ShardedState,
    build_index,
    consolidate,
    save_sharded,
    write_folder,
)
from zeroio.checkpoint.consolidate import write_safetensors
from zeroio.checkpoint.engine_io import _hf_config
from zeroio.checkpoint.state import Segment
from zeroio.errors import CheckpointError
from zeroio.testing.train_cli import zeroio_here

SCRIPT = Path(__file__).resolve().parents[1] / "zeroio" / "io" / "recover.py"
SINGLE, SHARDED = 10**9, 20_000  # max shard bytes: one file; several (the model is ~100 kB)


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32))


def _checkpoint(root: Path, seed: int) -> Path:
    model = _model(seed)
    named = dict(model.named_parameters())
    index = build_index([(n, tuple(p.shape)) for n, p in named.items()])
    flat = torch.cat([p.detach().reshape(-1) for p in named.values()])
    state = ShardedState(index=index, arrays={"fp32": [Segment(0, flat)]}, meta={"hf_config": _hf_config(model)})
    save_sharded(state, root, "t", options=SaveOptions(progress=False))
    return root


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return _checkpoint(base / "old", 0), _checkpoint(base / "new", 1)


def _consolidate(ckpt: Path, out: Path, shard: int) -> None:
    write_safetensors(ckpt, out, max_shard_bytes=shard, progress=False)


def _recover(ckpt: Path, out: Path, shard: int) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(ckpt), str(out), "--max-shard-size", str(shard)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _cli(ckpt: Path, out: Path, shard: int) -> None:
    # `zeroio consolidate`: the command's own main, in this process
    proc = zeroio_here(["consolidate", str(ckpt), str(out), "--quiet", "--max-shard-size",
                        str(shard)])
    assert proc.returncode == 0, proc.stderr


def _write_folder(ckpt: Path, out: Path, shard: int) -> None:
    write_folder(consolidate(ckpt), out, hf_config=json.loads(
        (ckpt / "t" / "manifest.json").read_text())["meta"]["hf_config"], max_shard_bytes=shard)


def _assert_loads(out: Path, ckpt: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(out)
    want = consolidate(ckpt)
    got = dict(model.named_parameters())
    for name, t in want.items():
        assert torch.equal(got[name].detach(), t), name


@pytest.mark.parametrize("writer", [_consolidate, _cli, _recover, _write_folder])
@pytest.mark.parametrize("first, second", [(SINGLE, SHARDED), (SHARDED, SINGLE)])
def test_new_export_replaces_the_old_and_keeps_other_files(ckpts, tmp_path, writer, first, second):
    old, new = ckpts
    out = tmp_path / "export"
    writer(old, out, first)
    (out / "tokenizer.json").write_text("{}")  # the user's own files
    (out / "model.fp16.safetensors").write_text("not ours")
    (out / "README.md").write_text("notes")
    writer(new, out, second)
    _assert_loads(out, new)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    if second == SINGLE:
        assert "model.safetensors" in names and not shards and "model.safetensors.index.json" not in names
    else:
        assert "model.safetensors" not in names and shards
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards  # no stale shard of the old export
    assert {"tokenizer.json", "model.fp16.safetensors", "README.md", "config.json"} <= set(names)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_export_leaves_the_earlier_one(ckpts, tmp_path):
    old, new = ckpts
    out = tmp_path / "export"
    _consolidate(old, out, SHARDED)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    broken = tmp_path / "broken"
    shutil.copytree(new, broken)
    chunk = broken / "t" / "fp32" / "c" / "0"
    os.truncate(chunk, chunk.stat().st_size - 4)
    with pytest.raises(CheckpointError, match="truncated"):
        _consolidate(broken, out, SINGLE)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_file_named_like_the_folder_is_refused(ckpts, tmp_path):
    out = tmp_path / "export"
    out.write_text("a file")
    with pytest.raises(CheckpointError, match="not a folder"):
        _consolidate(ckpts[0], out, SINGLE)
    assert out.read_text() == "a file"


def test_save_16bit_model_replaces_an_earlier_export(tmp_path, monkeypatch):
    """engine.save_16bit_model (one process): a sharded export over a single-file one, then
    a single file over shards; from_pretrained loads the engine's weights each time."""
    import zeroio
    from zeroio.checkpoint import export16

    monkeypatch.setenv("ZEROIO_HOST_MEMORY", "off")
    engine, *_ = zeroio.initialize(model=_model(0), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}})
    out = tmp_path / "export"
    try:
        for i, shard in enumerate((SINGLE, SHARDED, SINGLE)):
            ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(i))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()  # new weights for each export
            export16.save_16bit_model(engine, out, max_shard_bytes=shard)
            loaded = dict(LlamaForCausalLM.from_pretrained(out).named_parameters())
            for name, p in engine.module.named_parameters():
                assert torch.equal(loaded[name].detach(), p.detach().float()), (i, name)
            names = {p.name for p in out.iterdir()}
            assert ("model.safetensors" in names) == (shard == SINGLE)
            assert ("model.safetensors.index.json" in names) == (shard == SHARDED)
    finally:
        engine.close()
