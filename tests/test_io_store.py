"""TensorStore: zarr compatibility, crc, concurrent range writes, ENOSPC."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
import zarr

from zeroio.errors import IntegrityError, SwapIOError
from zeroio.io import IOEngine, OsOps, TensorStore


@pytest.fixture
def store(tmp_path):
    s = TensorStore(tmp_path / "store", IOEngine(block_size=65536, queue_depth=4, thread_count=2))
    yield s
    s.close()
    s.engine.close()


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
