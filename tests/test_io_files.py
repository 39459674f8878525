"""Checkpoint file access goes through zeroio/io/ and keeps its bytes.

- The one crc32c helper (zeroio.io.crc) against a bitwise crc32c written here from the
  polynomial: plain, extended, combined, over zeros; TensorStore's chunk crcs and a
  checkpoint's manifest chunk crcs are that crc of the raw file bytes.
- The one atomic write: the bytes on disk are exactly the text asked for (the JSON that
  checkpoints and TensorStore wrote before it existed), the mode follows the umask or is
  the one asked for, no temp file is left, and a write that fails keeps the old file.
- A fault injected in the io layer's syscalls (OsOps) fails a save with an error, and the
  previous tag, `latest` and the directory tree are as they were.
- The config's aio block reaches the checkpoint pools of a live engine (threads, block
  size, queue depth) on save and load; without one, today's 4 threads and engine defaults.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

from zeroio.checkpoint import (
    SaveOptions,
    Segment,
    ShardedState,
    build_index,
    load_sharded,
    save_sharded,
)
from zeroio.io import files
from zeroio.io.crc import combine, crc32c, zeros_crc
from zeroio.io.osops import OsOps
from zeroio.io.settings import EngineSettings
from zeroio.testing import run_ranks


def ref_crc32c(data: bytes, crc: int = 0) -> int:
    """crc32c (Castagnoli, reflected 0x82F63B78), one bit at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- crc32c


def test_crc32c_is_the_castagnoli_crc_of_the_raw_bytes():
    assert ref_crc32c(b"123456789") == 0xE3069283  # the standard check value of crc32c
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 777, dtype=np.uint8), rng.integers(0, 256, 1000, dtype=np.uint8)
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(a) == ref_crc32c(a.tobytes())
    assert crc32c(torch.from_numpy(a.copy()).view(torch.uint8)) == ref_crc32c(a.tobytes())
    t = torch.randn(33)
    assert crc32c(t) == ref_crc32c(t.numpy().tobytes())
    assert crc32c(b, crc32c(a)) == ref_crc32c(a.tobytes() + b.tobytes())  # extended
    assert combine(crc32c(a), crc32c(b), b.nbytes) == ref_crc32c(a.tobytes() + b.tobytes())
    assert zeros_crc(5000) == ref_crc32c(bytes(5000))
    assert zeros_crc(300, crc32c(a)) == ref_crc32c(a.tobytes() + bytes(300))


def test_store_and_checkpoint_chunk_crcs_are_that_crc_of_the_file_bytes(tmp_path):
    from zeroio.io.store import TensorStore

    x = torch.randn(1500)
    with TensorStore(tmp_path / "s") as store:
        store.create("x", 1500, torch.float32, chunk_elems=1024, preallocate=False)
        store.write("x", x).result()
    for k in (0, 1):
        raw = (tmp_path / "s" / "x" / "c" / str(k)).read_bytes()
        assert int.from_bytes(raw[-4:], "little") == ref_crc32c(raw[:-4])

    index = build_index([("w", (50,))])
    save_sharded(ShardedState(index=index, arrays={"fp32": [Segment(0, torch.randn(50))]}), tmp_path / "ck",
                 "t", options=SaveOptions(chunk_bytes=128, progress=False))
    man = json.loads((tmp_path / "ck" / "t" / "manifest.json").read_text())
    crcs = man["arrays"]["fp32"]["chunk_crc32c"]
    assert len(crcs) == 2
    for i, c in enumerate(crcs):
        assert c == ref_crc32c((tmp_path / "ck" / "t" / "fp32" / "c" / str(i)).read_bytes())


# ---------------------------------------------------------------- the atomic write


def _mode(p) -> int:
    return p.stat().st_mode & 0o777


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_atomic_write_puts_exactly_the_text_with_the_umask_mode(tmp_path, umask):
    doc = {"b": [1, 2], "a": {"x": "é"}}
    old = os.umask(umask)
    try:
        files.atomic_write_json(tmp_path / "m.json", {"old": True})
        files.atomic_write_json(tmp_path / "m.json", doc)  # replaces
        files.atomic_write_text(tmp_path / "p", "secret", mode=0o600)
    finally:
        os.umask(old)
    # the bytes checkpoints wrote before: json.dumps(obj, indent=1, sort_keys=False) + "\n", UTF-8
    assert (tmp_path / "m.json").read_bytes() == b'{\n "b": [\n  1,\n  2\n ],\n "a": {\n  "x": "\\u00e9"\n }\n}\n'
    assert _mode(tmp_path / "m.json") == 0o666 & ~umask
    assert (tmp_path / "p").read_bytes() == b"secret" and _mode(tmp_path / "p") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "p"]  # no temp file left


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    files.atomic_write_text(tmp_path / "latest", "a\n")

    def no_fsync(self, fd):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(OsOps, "fsync", no_fsync)
    with pytest.raises(OSError, match="injected"):
        files.atomic_write_text(tmp_path / "latest", "b\n")
    assert (tmp_path / "latest").read_bytes() == b"a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_zarr_metadata_bytes_are_what_they_were(tmp_path):
    from zeroio.checkpoint import layout
    from zeroio.io.store import TensorStore

    with TensorStore(tmp_path / "s") as store:
        store.create("x", 10, torch.bfloat16, chunk_elems=2048, preallocate=False)
    meta = json.loads((tmp_path / "s" / "x" / "zarr.json").read_text())
    assert (tmp_path / "s" / "x" / "zarr.json").read_bytes() == json.dumps(meta, indent=2).encode()
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    assert (tmp_path / "s" / "zarr.json").read_bytes() == json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {}}, indent=2).encode()
    # a checkpoint's array: raw chunks, no crc codec, fill 0.0 for floats (written by hand here)
    want = {"zarr_format": 3, "node_type": "array", "shape": [10], "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {"torch_dtype": "bfloat16"}, "dimension_names": None}
    assert json.dumps(layout.array_metadata(10, torch.bfloat16, 4)) == json.dumps(want)
    assert layout.array_metadata(3, torch.float32, 4)["fill_value"] == 0.0
    assert layout.group_metadata() == {"zarr_format": 3, "node_type": "group", "attributes": {
        "zeroio": {"format": "zeroio-checkpoint", "format_version": layout.FORMAT_VERSION}}}


# ---------------------------------------------------------------- faults in the io layer


SHAPES = [("a.w", (7, 5)), ("a.b", (5,)), ("b.w", (5, 5))]
INDEX = build_index(SHAPES)
TOTAL = sum(e.numel for e in INDEX.values())
OPTS = SaveOptions(chunk_bytes=128, progress=False, threads=2)


def _state(seed: int) -> ShardedState:
    t = torch.randn(TOTAL, generator=torch.Generator().manual_seed(seed))
    return ShardedState(index=dict(INDEX), arrays={"fp32": [Segment(0, t[:30].clone()), Segment(30, t[30:].clone())]},
                        scalars={"seed": seed})


def _load(root, tag=None) -> tuple[int, torch.Tensor]:
    out = torch.full((TOTAL,), float("nan"))
    res = load_sharded(root, tag, ShardedState(index=dict(INDEX), arrays={"fp32": [Segment(0, out)]}))
    return res.scalars["seed"], out


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("where", ["piece", "manifest"])
@pytest.mark.parametrize("tag", ["t", "u"], ids=["existing-tag", "new-tag"])
def test_a_fault_in_the_io_layer_fails_the_save_and_keeps_the_previous_tag(tmp_path, monkeypatch, where, tag):
    root = tmp_path / "ck"
    save_sharded(_state(0), root, "t", options=OPTS)
    before = _tree(root)
    hits = []

    def failing(real):
        def call(self, fd, data, *offset):
            body = bytes(memoryview(data)[:40])
            if where == "piece" or body.startswith(b'{\n "format": "zeroio-checkpoint"'):
                hits.append(len(data))
                raise OSError(errno.EIO, "injected I/O error")
            return real(self, fd, data, *offset)
        return call

    # pieces are positional writes, JSON metadata whole-file atomic writes: both through OsOps
    name = "pwrite" if where == "piece" else "write"
    monkeypatch.setattr(OsOps, name, failing(getattr(OsOps, name)))
    with pytest.raises(OSError, match="injected I/O error"):
        save_sharded(_state(1), root, tag, options=OPTS)
    monkeypatch.undo()
    assert hits  # the fault was hit: the save's writes went through the io layer's OsOps
    assert _tree(root) == before  # tag, latest, every byte as it was; nothing left beside
    seed, got = _load(root)
    assert seed == 0 and torch.equal(got, torch.cat([s.tensor for s in _state(0).arrays["fp32"]]))


# ---------------------------------------------------------------- the aio block reaches the pools


def _save_and_load_with_spies(aio: dict | None, out: str):
    import zeroio
    import zeroio.checkpoint.reader as reader
    import zeroio.checkpoint.writer as writer

    seen = {"write_pools": [], "engines": []}

    class SpyIO(writer.FileIO):
        def __init__(self, threads=4):
            seen["write_pools"].append(threads)
            super().__init__(threads)

    real_open = files.open_engine

    def spy_open(settings):
        engine = real_open(settings)
        s = engine.settings
        seen["engines"].append([s.thread_count, s.block_size, s.queue_depth])
        return engine

    writer.FileIO = SpyIO
    writer.open_engine = reader.open_engine = spy_open
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, **({"aio": aio} if aio else {})}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(out, tag="s")
    saved_pools = list(seen["write_pools"])
    engine.load_checkpoint(out, tag="s")
    return {"saved_pools": saved_pools, "engines": seen["engines"]}


def test_the_aio_block_sizes_the_checkpoint_pools_and_none_keeps_the_defaults(tmp_path):
    tuned = {"block_size": 8192, "queue_depth": 2, "thread_count": 3}
    (with_aio,) = run_ranks(_save_and_load_with_spies, 1, tuned, str(tmp_path / "a"))
    (default,) = run_ranks(_save_and_load_with_spies, 1, None, str(tmp_path / "b"))
    assert with_aio["saved_pools"] == [3, 1]  # writes, then fsync + read-back (half of them)
    assert with_aio["engines"] and all(e == [3, 8192, 2] for e in with_aio["engines"])  # load verify + apply
    d = EngineSettings()
    assert default["saved_pools"] == [4, 2]
    assert default["engines"] and all(e == [4, d.block_size, d.queue_depth] for e in default["engines"])


def test_pool_settings_from_the_aio_block():
    assert files.FileIOSettings.from_aio(None) == files.FileIOSettings(threads=4, engine=None)
    # DeepSpeed's default block (configs/zero3-nvme.json has it) is no tuning: today's defaults
    ds_default = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                  "single_submit": False, "overlap_events": True, "use_gds": False}
    assert files.FileIOSettings.from_aio(ds_default) == files.FileIOSettings(threads=4)
    got = files.FileIOSettings.from_aio({"block_size": 4 << 20, "queue_depth": 32, "intra_op_parallelism": 8})
    assert got.threads == 8 and got.engine == EngineSettings(block_size=4 << 20, queue_depth=32, thread_count=8)
