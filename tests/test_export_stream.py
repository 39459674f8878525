"""The streamed safetensors export (`write_safetensors`): bytes, reads, read-ahead, failures.

References are independent of the code under test: safetensors' own save_file
over tensors cut by hand from the seeded source, and the chunk files on disk.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
import weakref

import pytest
import torch
from safetensors.torch import save_file

from zeroio.checkpoint import (
    SaveOptions,
    Segment,
    ShardedState,
    build_index,
    save_sharded,
    write_safetensors,
)
from zeroio.checkpoint.reader import ArrayReader
from zeroio.errors import CheckpointError

cons = importlib.import_module("zeroio.checkpoint.consolidate")  # the module, not the function

# names whose string order is not model order (layers.10 sorts before layers.2), sizes that
# straddle the 64-element chunks, a tensor larger than a chunk and a 0-d one
SHAPES = [("embed", (9, 13))] + [(f"layers.{i}.w", (5, 3 + i)) for i in range(12)] + [
    ("norm", ()), ("head", (13, 9))]
INDEX = build_index(SHAPES)
TOTAL = sum(e.numel for e in INDEX.values())
CHUNK_ELEMS = 64


def _full() -> torch.Tensor:
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(11))


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    full = _full()
    return {n: full[e.offset: e.offset + e.numel].view(e.shape).to(dtype) for n, e in INDEX.items()}


@pytest.fixture
def ckpt(tmp_path):
    state = ShardedState(index=dict(INDEX), arrays={"fp32": [Segment(0, _full())]}, meta={"stage": 1})
    save_sharded(state, tmp_path / "ck", "t", options=SaveOptions(chunk_bytes=CHUNK_ELEMS * 4, progress=False))
    return tmp_path / "ck"


def _count_reads(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = ArrayReader._chunk

    def chunk(self, engine, info, i):
        seen.append(i)
        return real(self, engine, info, i)

    monkeypatch.setattr(ArrayReader, "_chunk", chunk)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_equals_save_file_and_reads_each_chunk_once(ckpt, tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(cons, "STREAM_WINDOW", 7)  # pieces smaller than most tensors
    reads = _count_reads(monkeypatch)
    ref = _tensors(dtype)
    out = tmp_path / "one"
    write_safetensors(ckpt, out, "t", dtype=dtype, progress=False)
    save_file(ref, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    n_chunks = -(-TOTAL // CHUNK_ELEMS)
    assert reads == list(range(n_chunks))  # front to back, once each, despite the name order
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no .partial left

    # sharded: each file is save_file's file of its tensors (model-order runs)
    reads.clear()
    out = tmp_path / "sharded"
    files = write_safetensors(ckpt, out, "t", dtype=dtype, progress=False, max_shard_bytes=160)
    assert reads == list(range(n_chunks))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(INDEX) and len(files) > 3
    for f in sorted(set(index["weight_map"].values())):
        names = [n for n, ff in index["weight_map"].items() if ff == f]
        save_file({n: ref[n] for n in names}, str(tmp_path / "r.safetensors"), metadata={"format": "pt"})
        assert (out / f).read_bytes() == (tmp_path / "r.safetensors").read_bytes(), f


@pytest.mark.parametrize("depth", [1, 3])
def test_read_ahead_keeps_at_most_depth_plus_one_chunks(ckpt, tmp_path, monkeypatch, depth):
    """Slow reads and a slower writer: chunks pile up ahead of the writer as far as the bound
    lets them, and no further ([Note: read-ahead bound])."""
    real = ArrayReader._chunk
    lock = threading.Lock()
    live = {"now": 0, "peak": 0, "reading": 0, "peak_reading": 0}

    def gone():
        with lock:
            live["now"] -= 1

    def chunk(self, engine, info, i):
        with lock:
            live["reading"] += 1
            live["peak_reading"] = max(live["peak_reading"], live["reading"])
        time.sleep(0.003)
        data = real(self, engine, info, i)
        with lock:
            live["reading"] -= 1
            live["now"] += 1
            live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(data, gone)
        return data

    real_append = cons.SafetensorsStream.append

    def append(stream, values):
        time.sleep(0.01)
        real_append(stream, values)

    monkeypatch.setattr(ArrayReader, "_chunk", chunk)
    monkeypatch.setattr(cons.SafetensorsStream, "append", append)
    write_safetensors(ckpt, tmp_path / "o", "t", progress=False, read_ahead=depth)
    assert live["now"] == 0
    assert live["peak_reading"] <= depth + 1
    assert live["peak"] <= depth + 1, live
    assert live["peak"] == depth + 1, live  # the writer is slow: the reads did run ahead
    save_file(_tensors(torch.float32), str(tmp_path / "ref"), metadata={"format": "pt"})
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (tmp_path / "ref").read_bytes()


def test_corrupt_chunk_mid_file_raises_and_leaves_no_output(ckpt, tmp_path):
    bad = ckpt / "t" / "fp32" / "c" / "2"
    raw = bytearray(bad.read_bytes())
    raw[5] ^= 0x40
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"fp32/c/2 \(array 'fp32', chunk 2\) is corrupt"):
        write_safetensors(ckpt, out, "t", progress=False, max_shard_bytes=160)
    assert not out.exists()  # the export was staged beside it: no folder, no .partial files
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_existing_file_is_kept_when_the_export_fails(ckpt, tmp_path):
    """A failed re-export leaves the previous good file in place (the new one was a .partial)."""
    out = tmp_path / "out"
    write_safetensors(ckpt, out, "t", progress=False)
    before = (out / "model.safetensors").read_bytes()
    (ckpt / "t" / "fp32" / "c" / "4").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint file \S*fp32/c/4 is missing"):
        write_safetensors(ckpt, out, "t", progress=False)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_unreadable_chunk_names_its_path(ckpt, tmp_path):
    path = ckpt / "t" / "fp32" / "c" / "1"
    path.unlink()
    path.mkdir()  # a directory where the chunk file should be: the read cannot open it
    with pytest.raises(CheckpointError, match=str(path)):
        write_safetensors(ckpt, tmp_path / "out", "t", progress=False)
    assert not (tmp_path / "out").exists()


def test_read_ahead_depth_is_checked(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="depth must be >= 1"):
        write_safetensors(ckpt, tmp_path / "out", "t", progress=False, read_ahead=-1)
