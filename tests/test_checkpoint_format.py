"""The checkpoint format layer, without an engine: ShardedState in, bytes on disk, ranges out.

References are independent of the code under test: google_crc32c over whole
byte strings, zarr-python reading the arrays, tensors rebuilt from a seed.
"""

from __future__ import annotations

import json
import os
import warnings

import google_crc32c
import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroio.checkpoint import (
    CheckpointWarning,
    Comm,
    LazySegment,
    SaveOptions,
    Segment,
    ShardedState,
    build_index,
    consolidate,
    load_sharded,
    save_sharded,
    scan_tags,
)
from zeroio.errors import CheckpointError, RankFailedError
from zeroio.io.crc import combine
from zeroio.testing import run_ranks

SHAPES = [("embed.weight", (7, 5)), ("block.0.w", (5, 5)), ("block.0.b", (5,)), ("head.w", (3, 5)), ("head.b", (3,))]
INDEX = build_index(SHAPES)
TOTAL = sum(int(np.prod(s)) for _, s in SHAPES)  # 98
OPTS = SaveOptions(chunk_bytes=64, progress=False)  # 16 fp32 elements a chunk: pieces straddle chunks


def reference(kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + len(kind))
    t = torch.randn(TOTAL, generator=g)
    return t.to(torch.bfloat16) if kind == "param16" else t


def bounds(world: int, rank: int, total: int = TOTAL) -> tuple[int, int]:
    """Uneven rank ranges (not aligned to chunks or parameters)."""
    cuts = [0] + [min(total, (i * total) // world + (3 if i % 2 else -2)) for i in range(1, world)] + [total]
    return cuts[rank], cuts[rank + 1]


def sharded(rank: int, world: int, seed: int = 0, kinds=("fp32", "exp_avg", "param16")) -> ShardedState:
    lo, hi = bounds(world, rank)
    arrays = {}
    for k in kinds:
        full = reference(k, seed)
        # two segments per rank, like a stage that holds a shard in two groups
        mid = (lo + hi) // 2
        arrays[k] = [Segment(lo, full[lo:mid].clone()), Segment(mid, full[mid:hi].clone())]
    return ShardedState(
        index=dict(INDEX), arrays=arrays,
        scalars={"step": 5 + seed}, rank_scalars={"rank": rank, "rng": [rank, seed]},
        client_state={"epoch": seed, "note": "hi"}, meta={"stage": 2},
    )


def empty_like_template(rank: int, world: int, kinds=("fp32", "exp_avg", "param16")) -> ShardedState:
    st_ = sharded(rank, world, 0, kinds)
    for segs in st_.arrays.values():
        for s in segs:
            s.tensor.fill_(float("nan") if s.tensor.is_floating_point() else 0)
    return st_


# ---------------------------------------------------------------- crc combine


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc_combine_equals_crc_of_concatenation(a, b):
    ca, cb = google_crc32c.value(a), google_crc32c.value(b)
    assert combine(ca, cb, len(b)) == google_crc32c.value(a + b)


# ---------------------------------------------------------------- single process


def test_roundtrip_single_process_and_zarr_reads_arrays(tmp_path):
    state = sharded(0, 1)
    save_sharded(state, tmp_path, "t1", options=OPTS)
    assert (tmp_path / "latest").read_text().strip() == "t1"
    # zarr-python itself reads the arrays: the layout is plain zarr v3
    z = zarr.open_array(str(tmp_path / "t1" / "fp32"), mode="r")
    np.testing.assert_array_equal(z[:], reference("fp32").numpy())
    z16 = zarr.open_array(str(tmp_path / "t1" / "param16"), mode="r")
    assert z16.attrs["torch_dtype"] == "bfloat16"
    bits = reference("param16").view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(z16[:], bits)

    tmpl = empty_like_template(0, 1)
    res = load_sharded(tmp_path, None, tmpl)
    for k, segs in tmpl.arrays.items():
        got = torch.cat([s.tensor for s in segs])
        assert torch.equal(got, reference(k))
    assert res.scalars == {"step": 5} and res.client_state == {"epoch": 0, "note": "hi"}
    assert res.rank_scalars == {"rank": 0, "rng": [0, 0]} and res.tag == "t1"

    full = consolidate(tmp_path)
    assert list(full) == [n for n, _ in SHAPES]
    for name, shape in SHAPES:
        e = INDEX[name]
        assert torch.equal(full[name], reference("fp32")[e.offset:e.offset + e.numel].view(shape))


def test_gap_in_segments_fails_save_and_leaves_no_manifest(tmp_path):
    state = sharded(0, 1)
    state.arrays["fp32"] = state.arrays["fp32"][:1]  # second half of the model missing
    with pytest.raises(CheckpointError, match="do not tile"):
        save_sharded(state, tmp_path, "gap", options=OPTS)
    assert not (tmp_path / "gap" / "manifest.json").exists()
    assert not (tmp_path / "latest").exists()


def test_save_that_does_not_fit_fails_before_writing_and_keeps_the_last(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    save_sharded(sharded(0, 1), tmp_path, "good", options=OPTS)
    before = {p: p.read_bytes() for p in (tmp_path / "good").rglob("*") if p.is_file()}
    # the whole checkpoint by hand: the index's 83 elements; fp32 and exp_avg in 16-element
    # chunks (6 of 64 bytes each), param16 (bf16) in 32-element chunks (3 of 64 bytes)
    assert sum(e.numel for e in INDEX.values()) == 83
    need = 6 * 64 + 6 * 64 + 3 * 64
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, need - 1))
    with pytest.raises(CheckpointError, match=r"needs 0\.00 GB .* has 0\.00 GB free"):
        save_sharded(sharded(0, 1, seed=1), tmp_path, "next", options=OPTS)
    assert not (tmp_path / "next").exists()
    assert (tmp_path / "latest").read_text().strip() == "good"
    assert before == {p: p.read_bytes() for p in (tmp_path / "good").rglob("*") if p.is_file()}
    # exactly enough fits
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, need))
    save_sharded(sharded(0, 1, seed=1), tmp_path, "next", options=OPTS)
    # replacing a tag keeps the old copy until the new one is complete: its bytes are not counted
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, need - 1))
    with pytest.raises(CheckpointError, match=r"existing 'next' is kept until the new copy is complete"):
        save_sharded(sharded(0, 1, seed=2), tmp_path, "next", options=OPTS)
    assert load_sharded(tmp_path, "next", empty_like_template(0, 1)).scalars == {"step": 6}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, need))
    save_sharded(sharded(0, 1, seed=2), tmp_path, "next", options=OPTS)
    res = load_sharded(tmp_path, "next", empty_like_template(0, 1))
    assert res.scalars == {"step": 7}


# ---------------------------------------------------------------- multi-rank, N -> M


def _save_rank(root, world, tag, seed):
    rank = Comm.default().rank
    save_sharded(sharded(rank, world, seed), root, tag, options=OPTS)
    return rank


def _load_rank(root, tag, world_written):
    comm = Comm.default()
    tmpl = empty_like_template(comm.rank, comm.world_size)
    res = load_sharded(root, tag, tmpl)
    lo, hi = bounds(comm.world_size, comm.rank)
    ok = all(
        torch.equal(torch.cat([s.tensor for s in segs]), reference(k, res.scalars["step"] - 5)[lo:hi])
        for k, segs in tmpl.arrays.items()
    )
    return ok, res.rank_scalars, res.manifest.world_size


def test_three_ranks_write_two_and_one_read(tmp_path):
    assert run_ranks(_save_rank, 3, str(tmp_path), 3, "w3", 1) == [0, 1, 2]
    man = json.loads((tmp_path / "w3" / "manifest.json").read_text())
    assert man["world_size"] == 3 and man["meta"] == {"stage": 2}
    # chunk crcs in the manifest are crc32c of the whole chunk files (padding included)
    for kind, a in man["arrays"].items():
        for i, c in enumerate(a["chunk_crc32c"]):
            assert google_crc32c.value((tmp_path / "w3" / kind / "c" / str(i)).read_bytes()) == c
    two = run_ranks(_load_rank, 2, str(tmp_path), "w3", 3)
    assert [ok for ok, _, _ in two] == [True, True]
    assert [r["rank"] for _, r, _ in two] == [0, 1] and two[0][2] == 3
    ok, rs, _ = _load_rank_single(tmp_path)
    assert ok and rs["rank"] == 0


def _load_rank_single(root):
    return _load_rank(root, "w3", 3)


# ---------------------------------------------------------------- bad input


@pytest.fixture
def saved(tmp_path):
    save_sharded(sharded(0, 1), tmp_path, "good", options=OPTS)
    return tmp_path


def test_corrupted_chunk_names_file_and_chunk(saved):
    path = saved / "good" / "exp_avg" / "c" / "2"
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0x40
    path.write_bytes(bytes(raw))
    tmpl = empty_like_template(0, 1)
    with pytest.raises(CheckpointError, match=r"exp_avg/c/2.*chunk 2\) is corrupt"):
        load_sharded(saved, "good", tmpl)
    # fp32 alone is intact and loads
    load_sharded(saved, "good", tmpl, kinds=["fp32"])


def test_truncated_chunk_names_file(saved):
    path = saved / "good" / "fp32" / "c" / "1"
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"chunk 1.*fp32/c/1 is truncated"):
        consolidate(saved)
    os.unlink(path)
    with pytest.raises(CheckpointError, match=r"fp32/c/1 is missing"):
        consolidate(saved)


def test_newer_format_version(saved):
    p = saved / "good" / "manifest.json"
    doc = json.loads(p.read_text())
    doc["format_version"] = 99
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"manifest.json has format_version 99.*Upgrade zeroio"):
        load_sharded(saved, "good", empty_like_template(0, 1))


def test_other_model_strict_and_non_strict(saved):
    shapes = [("embed.weight", (7, 5)), ("block.0.w", (5, 4)), ("block.0.b", (5,)), ("extra", (2,)),
              ("head.w", (3, 5)), ("head.b", (3,))]
    index = build_index(shapes)
    total = sum(e.numel for e in index.values())
    buf = torch.full((total,), -1.0)
    tmpl = ShardedState(index=index, arrays={"fp32": [Segment(0, buf)]})
    with pytest.raises(CheckpointError, match=r"another model.*not in the checkpoint.*'extra'.*block\.0\.w: "
                                              r"checkpoint \(5, 5\) vs model \(5, 4\).*strict=False"):
        load_sharded(saved, "good", tmpl)
    res = load_sharded(saved, "good", tmpl, strict=False)
    assert res.skipped_names == ["block.0.w", "extra"]
    ref = reference("fp32")
    for name in res.loaded_names:
        e, ce = index[name], INDEX[name]
        assert torch.equal(buf[e.offset:e.offset + e.numel], ref[ce.offset:ce.offset + ce.numel])
    for name in res.skipped_names:
        e = index[name]
        assert (buf[e.offset:e.offset + e.numel] == -1).all()  # untouched


def test_missing_tag_and_missing_array(saved):
    with pytest.raises(CheckpointError, match=r"tag 'nope' not found.*\['good'\]"):
        load_sharded(saved, "nope", empty_like_template(0, 1))
    with pytest.raises(CheckpointError, match=r"does not exist"):
        load_sharded(saved / "absent", None, empty_like_template(0, 1))
    tmpl = empty_like_template(0, 1, kinds=("fp32", "exp_avg_sq"))
    with pytest.raises(CheckpointError, match=r"no array 'exp_avg_sq'"):
        load_sharded(saved, "good", tmpl)
    assert all(torch.isnan(s.tensor).all() for s in tmpl.arrays["fp32"])  # nothing half-loaded


# ---------------------------------------------------------------- a rank dies mid-save


def _save_then_die(root, world, tag):
    comm = Comm.default()
    if comm.rank == 1:
        import zeroio.checkpoint.writer as writer

        real, calls = writer.pwrite_all, []

        def dying(*a):
            calls.append(1)
            if len(calls) == 3:
                os._exit(17)  # a crash with some of this rank's pieces on disk
            real(*a)

        writer.pwrite_all = dying
    save_sharded(sharded(comm.rank, world, 1), root, tag, options=SaveOptions(chunk_bytes=64, progress=False,
                                                                            threads=1))


@pytest.mark.parametrize("tag", ["second", "first"], ids=["new-tag", "existing-tag"])
def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path, tag):
    save_sharded(sharded(0, 1, 0), tmp_path, "first", options=OPTS)
    with pytest.raises(RankFailedError):
        run_ranks(_save_then_die, 2, str(tmp_path), 2, tag, timeout=60)
    # the save wrote beside the tag, never into it; its staging folder has no manifest (rank 0,
    # which saw rank 1 die, may already have removed it)
    stage = tmp_path / f".zeroio-new.{tag}"
    assert not (stage / "manifest.json").exists()
    status = {s.tag: s.complete for s in scan_tags(tmp_path)}
    assert status == {"first": True}
    assert (tmp_path / "latest").read_text().strip() == "first"
    tmpl = empty_like_template(0, 1)
    res = load_sharded(tmp_path, None, tmpl)  # the old copy of "first", whole
    assert res.tag == "first" and res.scalars["step"] == 5
    for k, segs in tmpl.arrays.items():
        assert torch.equal(torch.cat([s.tensor for s in segs]), reference(k, 0))
    if tag == "second":
        with pytest.raises(CheckpointError, match=r"tag 'second' not found.*\['first'\]"):
            load_sharded(tmp_path, "second", tmpl)
    save_sharded(sharded(0, 1, 2), tmp_path, "third", options=OPTS)  # the next save cleans up
    assert not stage.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["first", "latest", "third"]


def test_latest_naming_broken_tag_falls_back_with_warning(saved):
    save_sharded(sharded(0, 1, 2), saved, "newer", options=OPTS)
    (saved / "newer" / "manifest.json").unlink()
    assert (saved / "latest").read_text().strip() == "newer"
    with pytest.warns(CheckpointWarning, match=r"`latest` names 'newer'.*'good'"):
        res = load_sharded(saved, None, empty_like_template(0, 1))
    assert res.tag == "good"
    with pytest.warns(CheckpointWarning, match=r"ignoring incomplete checkpoint .*newer"):
        load_sharded(saved, "good", empty_like_template(0, 1), kinds=["fp32"])  # explicit: still reported
    (saved / "newer" / "zarr.json").unlink()  # no longer a zeroio tag at all: nothing to report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_sharded(saved, "good", empty_like_template(0, 1), kinds=["fp32"])


# ---------------------------------------------------------------- command line


def test_cli_consolidate_sharded_bf16_and_inspect(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from zeroio.cli.main import main

    out = tmp_path / "st"
    # 100-byte shards: every parameter (>= 6 bf16 bytes) lands in a small file, index written
    assert main(["consolidate", str(saved), str(out), "--dtype", "bf16", "--max-shard-size", "100", "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(INDEX) and len(files) == len(set(index["weight_map"].values())) + 1
    ref = reference("fp32")
    for name, e in INDEX.items():
        t = load_file(str(out / index["weight_map"][name]))[name]
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, ref[e.offset:e.offset + e.numel].view(e.shape).to(torch.bfloat16))
    assert index["metadata"]["total_size"] == TOTAL * 2

    save_sharded(sharded(0, 1, 3), saved, "broken", options=OPTS)
    (saved / "broken" / "manifest.json").unlink()
    assert main(["inspect", str(saved), "--json"]) == 1  # an invalid tag is present
    info = json.loads(capsys.readouterr().out)
    tags = {t["tag"]: t for t in info["tags"]}
    assert info["latest"] == "broken" and not tags["broken"]["complete"]
    assert "interrupted" in tags["broken"]["problem"]
    good = tags["good"]
    assert (good["world_size"], good["stage"], good["parameters"], good["numel"]) == (1, 2, 5, TOTAL)
    assert good["arrays"]["param16"] == {"dtype": "bfloat16", "numel": TOTAL, "bytes": TOTAL * 2,
                                         "chunks": -(-TOTAL // 32)}
    assert main(["inspect", str(saved), "--tag", "good"]) == 0
    text = capsys.readouterr().out
    assert "good: written" in text and "by 1 rank(s) at stage 2" in text and "exp_avg" in text
    path = saved / "good" / "fp32" / "c" / "0"
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(saved), "--tag", "good", "--verify", "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)["tags"][0]
    assert bad["verified"] is False and "fp32/c/0" in bad["problem"]


# ---------------------------------------------------------------- write path: direct I/O, lazy pieces, verify


def _big_state(total: int) -> tuple[ShardedState, torch.Tensor]:
    """One fp32 array over ``total`` elements: a plain segment and a lazily read one, split
    off a page boundary so some pieces are 4096-aligned in the file and some are not."""
    full = torch.randn(total, generator=torch.Generator().manual_seed(3))
    cut = 4096 + 1000
    reads = []

    def read(lo, n):
        reads.append((lo, n))
        return full[cut + lo: cut + lo + n].clone()

    lazy = LazySegment(offset=cut, numel=total - cut, dtype=torch.float32, read=read)
    state = ShardedState(index=build_index([("w", (total,))]),
                         arrays={"fp32": [Segment(0, full[:cut].clone()), lazy]}, meta={"stage": 1})
    return state, full, reads


@pytest.mark.parametrize("direct", [False, True])
def test_direct_and_lazy_pieces_write_the_exact_bytes(tmp_path, direct):
    total = 3 * 4096 + 77
    state, full, reads = _big_state(total)
    opts = SaveOptions(chunk_bytes=4 * 4096, progress=False, direct=direct)  # 4096 elements a chunk
    save_sharded(state, tmp_path, "d", options=opts)
    # the lazy segment was read in pieces no larger than a chunk, each once
    assert sorted(reads) == [(0, 3096), (3096, 4096), (7192, 77)]
    raw = b"".join((tmp_path / "d" / "fp32" / "c" / str(i)).read_bytes() for i in range(4))
    want = full.numpy().tobytes()
    assert raw[:len(want)] == want and raw[len(want):] == bytes(4 * 4096 * 4 - len(want))
    man = json.loads((tmp_path / "d" / "manifest.json").read_text())
    for i, c in enumerate(man["arrays"]["fp32"]["chunk_crc32c"]):
        assert google_crc32c.value((tmp_path / "d" / "fp32" / "c" / str(i)).read_bytes()) == c
    out = torch.full((total,), float("nan"))
    load_sharded(tmp_path, "d", ShardedState(index=state.index, arrays={"fp32": [Segment(0, out)]}))
    assert torch.equal(out, full)


def test_read_back_catches_a_write_the_storage_did_not_keep(tmp_path, monkeypatch):
    import zeroio.checkpoint.writer as writer

    real = writer.pwrite_all

    def flip_one_byte(path, data, offset):
        bad = data.copy()
        bad[len(bad) // 2] ^= 0x40
        real(path, bad, offset)

    monkeypatch.setattr(writer, "pwrite_all", flip_one_byte)
    with pytest.raises(CheckpointError, match="did not keep what was written"):
        save_sharded(sharded(0, 1), tmp_path, "bad", options=OPTS)
    assert not (tmp_path / "bad" / "manifest.json").exists()
