"""recover.py on what zeroio writes: a default `zeroio train` checkpoint (format 3), format 1
and 2 manifests, 16-bit weights, many chunks; and each kind of damage, run where torch and
zeroio cannot be imported. The reference is `zeroio consolidate`'s output, byte for byte."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroio.checkpoint import (
    SaveOptions,
    ShardedState,
    build_index,
    save_sharded,
    write_safetensors,
)
from zeroio.checkpoint.state import Segment
from zeroio.testing.train_cli import run_train, zeroio_here

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "zeroio" / "io" / "recover.py"
# torch, zeroio and google_crc32c (so the numpy crc32c runs) are unimportable for the script
_BLOCKED = ("import runpy, sys\n"
            "for m in ('torch', 'zeroio', 'google_crc32c', 'zarr'):\n"
            "    sys.modules[m] = None\n"
            "sys.argv = ['recover.py', *sys.argv[1:]]\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")


def recover_alone(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", _BLOCKED, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300, cwd="/")


def consolidate_cli(ckpt: Path, out: Path, *args: str) -> None:
    # `zeroio consolidate`: the command's own main, in this process
    proc = zeroio_here(["consolidate", str(ckpt), str(out), "--quiet", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]


def same_folders(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), f"{n} differs"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The checkpoint directory of a one-step default `zeroio train` run (stage 3, NVMe)."""
    out = tmp_path_factory.mktemp("train") / "run"
    run_train(out, ["--steps", "1", "--seq-len", "16", "--micro-batch", "1", "--json"], os.environ)
    return out / "checkpoints"


def _tag(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_default_train_checkpoint_equals_consolidate(trained, tmp_path, dtype):
    doc = json.loads((_tag(trained) / "manifest.json").read_text())
    assert doc["format_version"] == 3 and doc["arrays"]["exp_avg"]["layout"] == "extents"
    want, got = tmp_path / "want", tmp_path / "got"
    extra = ["--dtype", dtype] if dtype else []
    consolidate_cli(trained, want, *extra)
    proc = recover_alone(trained, got, "--verify", *extra)
    assert proc.returncode == 0, proc.stderr
    same_folders(want, got)


def _damage_chunk(tag: Path, how: str) -> Path:
    chunk = tag / "fp32" / "c" / "0"
    if how == "deleted":
        chunk.unlink()
    elif how == "truncated":
        os.truncate(chunk, chunk.stat().st_size // 2)
    elif how == "oversized":
        os.truncate(chunk, 1 << 40)  # sparse: a reader that trusts the size allocates 1 TiB
    elif how == "crc":
        data = bytearray(chunk.read_bytes())
        data[100] ^= 0x01
        chunk.write_bytes(bytes(data))
    return chunk


def _damage_metadata(tag: Path, how: str) -> Path:
    meta = tag / "fp32" / "zarr.json"
    doc = json.loads(meta.read_text())
    if how == "halved":
        doc["shape"] = [doc["shape"][0] // 2]
    else:
        doc["codecs"] = [{"name": "bytes", "configuration": {"endian": "big"}}]
    meta.write_text(json.dumps(doc))
    return meta


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "truncated", "oversized", "crc", "halved", "big-endian"])
@pytest.mark.parametrize("verify", [False, True])
def test_each_damage_fails_naming_the_file_and_writes_nothing(trained, tmp_path, how, verify):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    tag = _tag(ckpt)
    bad = _damage_chunk(tag, how) if how in ("deleted", "truncated", "oversized", "crc") \
        else _damage_metadata(tag, "halved" if how == "halved" else "big")
    out = tmp_path / "out"
    proc = recover_alone(ckpt, out, *(["--verify"] if verify else []))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0], proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.slow
def test_damage_leaves_an_earlier_export_in_place(trained, tmp_path):
    out = tmp_path / "out"
    assert recover_alone(trained, out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    _damage_chunk(_tag(ckpt), "crc")
    assert recover_alone(ckpt, out).returncode == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_moment_damage_is_found_by_verify_only(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    extent = next((_tag(ckpt) / "exp_avg" / "x").iterdir())
    data = bytearray(extent.read_bytes())
    data[0] ^= 0x01
    extent.write_bytes(bytes(data))
    assert recover_alone(ckpt, tmp_path / "a").returncode == 0  # weights are whole
    proc = recover_alone(ckpt, tmp_path / "b", "--verify")
    assert proc.returncode == 1 and str(extent) in proc.stderr, proc.stderr


def _synthetic(root: Path, kind: str, dtype: torch.dtype, chunk_bytes: int) -> Path:
    shapes = [("embed.weight", (37, 11)), ("empty", (0,)), ("layers.0.w", (13, 17)),
              ("layers.10.w", (3,)), ("layers.2.b", (29,)), ("head", (5, 7, 3))]
    index = build_index(shapes)
    numel = sum(e.numel for e in index.values())
    g = torch.Generator().manual_seed(3)
    values = torch.randn(numel, generator=g).to(dtype)
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7F800000], dtype=torch.int64)
    values[7:12] = nans.to(torch.int32).view(torch.float32).to(dtype)  # NaNs of both signs, inf
    state = ShardedState(index=index, arrays={kind: [Segment(0, values)]},
                         meta={"hf_config": {"model_type": "llama", "torch_dtype": "float32"}})
    save_sharded(state, root, "t", options=SaveOptions(chunk_bytes=chunk_bytes, progress=False))
    return root


@pytest.mark.parametrize("kind, dtype", [("fp32", torch.float32), ("param16", torch.bfloat16),
                                         ("param16", torch.float16)])
@pytest.mark.parametrize("target", [None, "fp32", "bf16", "fp16"])
def test_many_chunks_16bit_weights_and_format_1(tmp_path, kind, dtype, target):
    ckpt = _synthetic(tmp_path / "ckpt", kind, dtype, chunk_bytes=128)
    assert len(list((ckpt / "t" / kind / "c").iterdir())) > 10
    want = tmp_path / "want"
    write_safetensors(ckpt, want, dtype=target, progress=False, max_shard_bytes=1000)
    assert (want / "model.safetensors.index.json").is_file()
    extra = (["--dtype", target] if target else []) + ["--max-shard-size", "1000"]
    assert recover_alone(ckpt, tmp_path / "v2", *extra).returncode == 0
    same_folders(want, tmp_path / "v2")
    man = ckpt / "t" / "manifest.json"  # format 1: the same, without the manifest's own crc
    doc = json.loads(man.read_text())
    doc.pop("manifest_crc32c")
    doc["format_version"] = 1
    man.write_text(json.dumps(doc))
    proc = recover_alone(ckpt, tmp_path / "v1", *extra)
    assert proc.returncode == 0, proc.stderr
    same_folders(want, tmp_path / "v1")


def test_newer_format_is_refused_naming_the_manifest(tmp_path):
    ckpt = _synthetic(tmp_path / "ckpt", "fp32", torch.float32, chunk_bytes=4096)
    man = ckpt / "t" / "manifest.json"
    doc = json.loads(man.read_text())
    doc["format_version"] = 4
    man.write_text(json.dumps(doc))
    proc = recover_alone(ckpt, tmp_path / "out")
    assert proc.returncode == 1 and str(man) in proc.stderr and "format_version 4" in proc.stderr


def test_numpy_crc32c_equals_google_crc32c():
    import google_crc32c

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import recover as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 4095, 16384, 16385, 3 * 16384 + 5, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert script._crc_numpy(data) == google_crc32c.value(data.tobytes()), n
    assert script._crc_numpy(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the check value
