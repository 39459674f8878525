"""TensorStore: zarr compatibility, crc, concurrent range writes, ENOSPC."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import google_crc32c
import numpy as np
import pytest
import torch
import zarr

from zeroio.errors import IntegrityError, SwapIOError
from zeroio.io import ArrayExistsError, ArrayNotFoundError, IOEngine, OsOps, TensorStore


@pytest.fixture
def store(tmp_path):
    s = TensorStore(tmp_path / "store", IOEngine(block_size=65536, queue_depth=4, thread_count=2))
    yield s
    s.close()
    s.engine.close()


def test_round_trip_and_zarr_open_reads_it(store):
    x = torch.randn(100_003)
    store.create("opt/fp32", x.numel(), torch.float32, chunk_elems=30_000)
    store.write("opt/fp32", x[:45_001]).result()
    store.write("opt/fp32", x[45_001:], 45_001).result()
    assert torch.equal(store.read("opt/fp32").result(), x)
    part = torch.empty(777)
    store.read_into("opt/fp32", part, 29_500).result()  # spans a chunk boundary
    assert torch.equal(part, x[29_500:30_277])
    group = zarr.open_group(store.root, mode="r")
    arr = group["opt/fp32"]
    assert arr.shape == (100_003,) and arr.chunks == (30_000,)
    np.testing.assert_array_equal(arr[:], x.numpy())
    np.testing.assert_array_equal(zarr.open(os.path.join(store.root, "opt", "fp32"), mode="r")[5:9], x[5:9].numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_floats_stored_as_raw_bits(store, dtype):
    x = torch.randn(5000).to(dtype)
    info = store.create("p", x.numel(), dtype)
    store.write("p", x).result()
    meta = json.loads(open(os.path.join(store.root, "p", "zarr.json")).read())
    assert meta["data_type"] == "uint16" and meta["attributes"]["zeroio"]["torch_dtype"] == str(dtype)[6:]
    raw = open(os.path.join(store.root, "p", "c", "0"), "rb").read()
    bits = x.view(torch.int16).numpy().tobytes()
    assert raw[: len(bits)] == bits  # raw little-endian bits, no conversion
    assert len(raw) == info.chunk_bytes + 4
    assert raw[-4:] == google_crc32c.value(raw[:-4]).to_bytes(4, "little")
    np.testing.assert_array_equal(zarr.open_group(store.root, mode="r")["p"][:], x.view(torch.int16).numpy().view(np.uint16))
    assert torch.equal(store.read("p").result().view(torch.int16), x.view(torch.int16))


def test_preallocated_array_reads_zeros_and_is_valid_zarr(store):
    store.create("z", 10_000, torch.float32, chunk_elems=4096)
    assert torch.equal(store.read("z").result(), torch.zeros(10_000))
    np.testing.assert_array_equal(zarr.open_group(store.root, mode="r")["z"][:], np.zeros(10_000, np.float32))


def _flip_byte(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_crc_corruption_detected_and_data_not_used(store):
    x = torch.randn(20_000)
    store.create("w", x.numel(), torch.float32, chunk_elems=8192)
    store.write("w", x).result()
    _flip_byte(os.path.join(store.root, "w", "c", "1"), 1000)
    with pytest.raises(IntegrityError, match=r"array 'w' chunk 1 .*crc32c mismatch"):
        store.read("w").result()
    sentinel = torch.full((100,), 42.0)
    with pytest.raises(IntegrityError, match="chunk 1"):
        store.read_into("w", sentinel, 8192 + 10).result()
    assert torch.equal(sentinel, torch.full((100,), 42.0))  # partial chunk: nothing copied
    with pytest.raises(IntegrityError, match="chunk 1"):  # no read-modify-write over bad data
        store.write("w", torch.ones(10), 8200).result()
    out = torch.empty(100)
    store.read_into("w", out, 10).result()  # chunk 0 is fine
    assert torch.equal(out, x[10:110])
    store.write("w", x[8192:16384], 8192).result()  # a whole-chunk write repairs it
    assert torch.equal(store.read("w").result(), x)


def test_truncated_and_missing_chunk(store):
    x = torch.randn(10_000)
    store.create("t", x.numel(), torch.float32, chunk_elems=4096)
    store.write("t", x).result()
    os.truncate(os.path.join(store.root, "t", "c", "2"), 100)
    with pytest.raises(IntegrityError, match="chunk 2 .*truncated"):
        store.read("t").result()
    os.unlink(os.path.join(store.root, "t", "c", "2"))
    with pytest.raises(IntegrityError, match="chunk 2 .*missing"):
        store.read("t").result()


def test_concurrent_unaligned_range_writes_threads(store):
    n = 50_000
    x = torch.randn(n)
    store.create("r", n, torch.float32, chunk_elems=4096)
    cuts = sorted({0, n, *np.random.default_rng(0).integers(1, n, 40).tolist()})
    futs = [store.write("r", x[a:b], a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    for f in futs:
        f.result(timeout=60)
    assert torch.equal(store.read("r").result(), x)


def _rank_write(root, rank, world, n):
    """Rank r writes pieces r, r+world, ... of 777 elements: every 1000-element chunk is
    shared by two or three ranks writing at the same time (read-modify-write races)."""
    x = torch.arange(n, dtype=torch.float32) * 0.5
    written = 0
    with TensorStore(root) as s:
        s.create("g", n, torch.float32, chunk_elems=1000)  # every rank calls create
        futs = []
        for a in range(rank * 777, n, world * 777):
            piece = x[a : min(a + 777, n)]
            futs.append(s.write("g", piece, a))
            written += piece.numel()
        for f in futs:
            f.result()
    return written


def test_concurrent_range_writes_from_processes(tmp_path):
    n, world = 20_011, 4
    # forkserver with torch preloaded: fresh processes (no inherited threads) that
    # pay torch's import once instead of once per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zeroio.io", "tests.test_io_store"])
    with ProcessPoolExecutor(world, mp_context=ctx) as ex:
        counts = list(ex.map(_rank_write, [str(tmp_path)] * world, range(world), [world] * world, [n] * world))
    assert sum(counts) == n
    with TensorStore(tmp_path) as s:  # M=3 readers of other ranges
        for r in range(3):
            lo, hi = r * n // 3, (r + 1) * n // 3
            out = torch.empty(hi - lo)
            s.read_into("g", out, lo).result()
            assert torch.equal(out, torch.arange(lo, hi, dtype=torch.float32) * 0.5)
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path), mode="r")["g"][:], np.arange(n, dtype=np.float32) * 0.5)


def test_create_idempotent_and_conflicts(store):
    a = store.create("x", 100, torch.float32)
    assert store.create("x", 100, torch.float32) == a
    with pytest.raises(ArrayExistsError, match="delete"):
        store.create("x", 101, torch.float32)
    assert store.has("x")
    store.delete("x")
    assert not store.has("x")
    with pytest.raises(ArrayNotFoundError):
        store.read("x")


def test_enospc_reported_at_create(tmp_path):
    class Full(OsOps):
        def disk_free(self, path):
            return 5000

    with TensorStore(tmp_path, IOEngine(os_ops=Full())) as s:
        with pytest.raises(SwapIOError) as info:
            s.create("big", 1_000_000, torch.float32)
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    # one chunk: 4_000_000 bytes rounded up to 4096 (977 pages = 4_001_792) + 4 crc bytes
    assert "big" in msg and "needs 4001796 bytes" in msg and "5000 bytes free" in msg

    class FallocateFails(OsOps):
        def posix_fallocate(self, fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

    with TensorStore(tmp_path, IOEngine(os_ops=FallocateFails())) as s:
        with pytest.raises(SwapIOError, match="no space left"):
            s.create("big2", 10_000, torch.float32)


_REAL_FULL_DISK = textwrap.dedent(
    """
    import errno, sys, torch
    from zeroio.errors import SwapIOError
    from zeroio.io import IOEngine, TensorStore
    root = sys.argv[1]
    with TensorStore(root) as s:
        try:
            s.create("huge", 2_000_000, torch.float32)
        except SwapIOError as e:
            assert e.errno == errno.ENOSPC and "needs" in str(e) and "free" in str(e), str(e)
        else:
            raise SystemExit("create on a 1 MiB filesystem did not fail")
    with IOEngine() as e:
        try:
            e.write(root + "/f", torch.zeros(4 << 20, dtype=torch.uint8)).result()
        except SwapIOError as err:
            assert err.errno == errno.ENOSPC and root in str(err), str(err)
        else:
            raise SystemExit("write of 4 MiB on a 1 MiB filesystem did not fail")
    print("OK")
    """
)


def test_enospc_on_a_real_full_filesystem(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(_REAL_FULL_DISK)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unprivileged user+mount namespaces are not available here")
    cmd = f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {script} {mnt}"
    res = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    if "mount:" in res.stderr and res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs unprivileged: {res.stderr.strip()}")
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


def test_bad_input(store):
    from zeroio.io import InvalidArrayName, IOArgumentError

    with pytest.raises(InvalidArrayName):
        store.create("../evil", 10, torch.float32)
    store.create("ok", 10, torch.float32)
    with pytest.raises(IOArgumentError, match="dtype"):
        store.write("ok", torch.zeros(10, dtype=torch.float64))
    with pytest.raises(IOArgumentError, match="outside"):
        store.write("ok", torch.zeros(5), 6)
    with pytest.raises(SwapIOError, match="not writable|cannot create"):
        TensorStore("/proc/zeroio_cannot_be_here")
