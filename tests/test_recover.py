"""zeroio/io/recover.py turns a checkpoint into the safetensors folder `zeroio consolidate`
writes, byte for byte, importing neither torch nor zeroio (stdlib, numpy, zarr only)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zeroio.checkpoint.layout import seal
from zeroio.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "zeroio" / "io" / "recover.py"


def _save(ckpt):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroio

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    engine, *_ = zeroio.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2}})
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for tag in ("t1", "t2"):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(ckpt, tag=tag)
    engine.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("recover") / "ckpt"
    run_ranks(_save, 2, str(root))
    return root


def _recover(*args: str, module: bool = False):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    head = ["-m", "zeroio.io.recover"] if module else [str(SCRIPT)]
    return subprocess.run([sys.executable, "-X", "importtime", *head, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _imported(stderr: str) -> set[str]:
    return {ln.split("|")[-1].strip() for ln in stderr.splitlines()
            if ln.startswith("import time:")}


def _same_folders(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), f"{n} differs"


@pytest.mark.parametrize("dtype, shard", [(None, None), ("bf16", None), ("fp16", 20_000),
                                          ("fp32", 30_000)])
def test_recover_equals_consolidate_byte_for_byte(ckpt, tmp_path, dtype, shard):
    from zeroio.checkpoint.consolidate import write_safetensors

    want, got = tmp_path / "consolidate", tmp_path / "recover"
    kw = {"max_shard_bytes": shard} if shard else {}
    write_safetensors(ckpt, want, dtype=dtype, progress=False, **kw)
    args = [str(ckpt), str(got)] + (["--dtype", dtype] if dtype else []) + (
        ["--max-shard-size", str(shard)] if shard else [])
    proc = _recover(*args, "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    heavy = sorted(m for m in _imported(proc.stderr) if m.split(".")[0] in ("torch", "zeroio"))
    assert not heavy, heavy[:10]
    if shard:
        assert (want / "model.safetensors.index.json").is_file()  # the sharded layout
    _same_folders(want, got)


def test_tensors_match_the_checkpoint_and_other_entry_points(ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file

    from zeroio.checkpoint import consolidate

    ref = consolidate(ckpt, tag="t1")
    tagged = tmp_path / "t1"
    assert _recover(str(ckpt), str(tagged), "--tag", "t1").returncode == 0
    got = load_file(tagged / "model.safetensors")
    assert list(sorted(got)) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.int32),
                                                          t.view(torch.int32)), name
    # a tag folder given directly, and python -m, give the same bytes
    direct, module = tmp_path / "direct", tmp_path / "module"
    assert _recover(str(ckpt / "t1"), str(direct)).returncode == 0
    proc = _recover(str(ckpt), str(module), "--tag", "t1", module=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _same_folders(tagged, direct)
    _same_folders(tagged, module)
    assert json.loads((tagged / "config.json").read_text())["hidden_size"] == 32


def test_manifest_read_tolerantly_and_clear_errors(ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    man = copy / "t2" / "manifest.json"
    doc = json.loads(man.read_text())
    doc["checksum"] = {"sha256": "0" * 64}
    doc["some_future_field"] = [1, 2]
    man.write_text(json.dumps(seal(doc)))  # a newer writer's keys, under its own crc
    ok = _recover(str(copy), str(tmp_path / "a"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    base = tmp_path / "b"
    assert _recover(str(ckpt), str(base)).returncode == 0
    _same_folders(base, tmp_path / "a")
    (copy / "t2" / "manifest.json").unlink()
    bad = _recover(str(copy), str(tmp_path / "c"), "--tag", "t2")
    assert bad.returncode == 1 and "no manifest.json" in bad.stderr and "--tag" in bad.stderr
    chunk = copy / "t1" / "fp32" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bad = _recover(str(copy), str(tmp_path / "d"), "--tag", "t1", "--verify")
    assert bad.returncode == 1 and "crc32c mismatch" in bad.stderr and "c/0" in bad.stderr
    edited = copy / "t1" / "manifest.json"
    edited.write_text(edited.read_text().replace('"stage": 2', '"stage": 3'))
    bad = _recover(str(copy), str(tmp_path / "e"), "--tag", "t1")
    assert bad.returncode == 1 and "manifest_crc32c" in bad.stderr and str(edited) in bad.stderr
