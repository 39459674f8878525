"""IOEngine: round trips against the raw file bytes, O_DIRECT and fallback, errors."""

from __future__ import annotations

import errno
import os
import threading
import warnings

import numpy as np
import pytest
import torch

from zeroio.errors import IntegrityError, SwapIOError
from zeroio.io import AlignedBuffer, IOEngine, OsOps
from zeroio.io.bench import direct_io_supported
from zeroio.io.engine import O_DIRECT, IOArgumentError


class RecordingOps(OsOps):
    """Records the flags of every open and the (fd, offset, length) of every transfer."""

    def __init__(self):
        self.lock = threading.Lock()
        self.opens: dict[int, int] = {}
        self.calls: list[tuple[int, int, int, int]] = []  # fd, offset, nbytes, address

    def open(self, path, flags, mode=0o644):
        fd = super().open(path, flags, mode)
        with self.lock:
            self.opens[fd] = flags
        return fd

    def _record(self, fd, buffers, offset):
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        addr = np.asarray(buffers[0]).ctypes.data
        with self.lock:
            self.calls.append((self.opens.get(fd, 0), offset, nbytes, addr))

    def preadv(self, fd, buffers, offset):
        self._record(fd, buffers, offset)
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        self._record(fd, buffers, offset)
        return super().pwritev(fd, buffers, offset)


def _rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    return torch.from_numpy(g.integers(0, 256, size=n, dtype=np.uint8))


@pytest.fixture(scope="module")
def engine():
    e = IOEngine(block_size=64 * 1024, queue_depth=4, thread_count=3)
    yield e
    e.close()


def test_round_trip_100mb_typed(tmp_path):
    n = 100 * 1000 * 1000 + 3  # 100 MB, not a multiple of 4096
    x = torch.randn(n // 4 + 1)
    with IOEngine(block_size=1 << 20, queue_depth=8, thread_count=2) as e:
        e.write(tmp_path / "big", x, 4096).result()
        y = torch.empty_like(x)
        e.read(tmp_path / "big", y, 4096).result()
    assert torch.equal(x, y)
    with open(tmp_path / "big", "rb") as f:
        f.seek(4096 + 4 * 12345)
        assert f.read(4) == x[12345].numpy().tobytes()


def test_odirect_path_used_with_aligned_requests(tmp_path):
    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    ops = RecordingOps()
    n = 3 * 65536 + 100  # aligned body + unaligned tail
    buf = AlignedBuffer(n, pin=False)
    buf.tensor.copy_(_rand_bytes(n, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on a filesystem that supports it
        with IOEngine(block_size=65536, queue_depth=2, thread_count=2, os_ops=ops) as e:
            e.write(tmp_path / "d", buf.tensor, 8192).result()
            out = AlignedBuffer(n, pin=False)
            e.read(tmp_path / "d", out.tensor, 8192).result()
    assert torch.equal(out.tensor, buf.tensor)
    direct = [c for c in ops.calls if c[0] & O_DIRECT]
    buffered = [c for c in ops.calls if not c[0] & O_DIRECT]
    assert sum(c[2] for c in direct) == 2 * (n - 100)  # body both ways went direct
    assert all(off % 4096 == 0 and ln % 4096 == 0 and addr % 4096 == 0 for _, off, ln, addr in direct)
    assert sum(c[2] for c in buffered) == 2 * 100  # only the tail was buffered
    # queue_depth=2 blocks of 64 KiB per syscall at most
    assert max(c[2] for c in direct) == 2 * 65536


def test_fallback_forced_and_warns_once(tmp_path):
    class NoDirect(RecordingOps):
        def open(self, path, flags, mode=0o644):
            if flags & O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().open(path, flags, mode)

    ops = NoDirect()
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported") as rec:
        with IOEngine(block_size=4096, queue_depth=4, thread_count=2, os_ops=ops) as e:
            for i in range(5):
                x = _rand_bytes(10_000 + i, i)
                e.write(tmp_path / "f", x, 4096 * i).result()
                y = torch.empty_like(x)
                e.read(tmp_path / "f", y, 4096 * i).result()
                assert torch.equal(x, y)
    assert len([w for w in rec if "O_DIRECT" in str(w.message)]) == 1
    assert ops.calls and not any(c[0] & O_DIRECT for c in ops.calls)


def test_direct_false_never_opens_odirect(tmp_path):
    ops = RecordingOps()
    with IOEngine(direct=False, os_ops=ops) as e:
        x = _rand_bytes(50_000, 3)
        e.write(tmp_path / "f", x).result()
        y = torch.empty_like(x)
        e.read(tmp_path / "f", y).result()
    assert torch.equal(x, y)
    assert not any(flags & O_DIRECT for flags in ops.opens.values())


def test_enospc_during_write_names_path_and_bytes(tmp_path):
    class Full(OsOps):
        def pwritev(self, fd, buffers, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        def disk_free(self, path):
            return 1234

    with IOEngine(os_ops=Full()) as e:
        with pytest.raises(SwapIOError) as info:
            e.write(tmp_path / "f", torch.zeros(50_000, dtype=torch.uint8)).result()
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert str(tmp_path / "f") in msg and "1234 bytes free" in msg and "needs" in msg


def test_preallocate_checks_free_space_up_front(tmp_path):
    class Small(OsOps):
        def disk_free(self, path):
            return 10_000

    with IOEngine(os_ops=Small()) as e:
        with pytest.raises(SwapIOError, match="needs 1000000 bytes, 10000 bytes free"):
            e.preallocate(tmp_path / "swap", 1_000_000)
        e.preallocate(tmp_path / "ok", 8192)
    assert os.path.getsize(tmp_path / "ok") == 8192


def test_missing_directory_and_bad_tensor(engine, tmp_path):
    with pytest.raises(SwapIOError, match="does not exist"):
        engine.write(tmp_path / "nope" / "f", torch.zeros(10)).result()
    with pytest.raises(IOArgumentError, match="contiguous"):
        engine.write(tmp_path / "f", torch.zeros(10, 10).t())


def test_config_object_and_keywords():
    class Aio:  # what the config layer's cfg.aio looks like
        block_size = 2 << 20
        queue_depth = 16
        intra_op_parallelism = 3
        single_submit = True
        overlap_events = True
        use_gds = False

    with IOEngine(Aio()) as e:
        assert (e.settings.block_size, e.settings.queue_depth, e.settings.thread_count) == (2 << 20, 16, 3)
        assert e.piece_bytes == 2 << 20  # single_submit: one block per syscall
    with IOEngine(Aio(), queue_depth=4, thread_count=2) as e:
        assert (e.settings.queue_depth, e.settings.thread_count) == (4, 2)


def test_asyncio_api(engine, tmp_path):
    import asyncio

    x = _rand_bytes(123_457, 9)
    y = torch.empty_like(x)

    async def main():
        await engine.awrite(tmp_path / "a", x, 4096)
        await engine.aread(tmp_path / "a", y, 4096)

    asyncio.run(main())
    assert torch.equal(x, y)


def test_direct_refused_at_io_time_falls_back(tmp_path):
    """Some filesystems accept O_DIRECT at open and refuse it per request (EINVAL)."""

    class RefuseDirectIO(RecordingOps):
        def preadv(self, fd, buffers, offset):
            if self.opens.get(fd, 0) & O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().preadv(fd, buffers, offset)

        def pwritev(self, fd, buffers, offset):
            if self.opens.get(fd, 0) & O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().pwritev(fd, buffers, offset)

    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT at open")
    x = _rand_bytes(3 * 4096 + 5, 4)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        with IOEngine(block_size=4096, os_ops=RefuseDirectIO()) as e:
            e.write(tmp_path / "f", x).result()
            y = torch.empty_like(x)
            e.read(tmp_path / "f", y).result()
    assert torch.equal(x, y) and (tmp_path / "f").read_bytes() == x.numpy().tobytes()


@pytest.mark.parametrize("kw", [{"block_size": 1000}, {"queue_depth": 0}, {"thread_count": -1}])
def test_bad_settings_are_config_errors(kw):
    from zeroio.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        IOEngine(**kw)
    assert info.value.key == f"aio.{next(iter(kw))}"


def test_unknown_setting_is_config_error():
    from zeroio.errors import ConfigError
    from zeroio.io import EngineSettings

    with pytest.raises(ConfigError, match="bogus"):
        EngineSettings.resolve(None, bogus=1)


def test_short_direct_read_is_not_mistaken_for_missing_odirect(tmp_path):
    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    (tmp_path / "s").write_bytes(b"y" * (3 * 4096 + 100))  # ends mid-block of the aligned body
    out = AlignedBuffer(8 * 4096, pin=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with IOEngine(block_size=4096, queue_depth=1) as e:
            with pytest.raises(IntegrityError, match="short read"):
                e.read(tmp_path / "s", out.tensor).result()


class _HeldWrites(OsOps):
    """Every write blocks until ``go`` is set (a disk busy writing back)."""

    def __init__(self):
        self.go = threading.Event()

    def pwritev(self, fd, buffers, offset):
        assert self.go.wait(30), "the write was never let through"
        return super().pwritev(fd, buffers, offset)

    def pwrite(self, fd, data, offset):
        assert self.go.wait(30), "the write was never let through"
        return super().pwrite(fd, data, offset)


def test_a_read_does_not_queue_behind_writes(tmp_path):
    """[Note: read and write lanes]: with one worker a read submitted after write-backs that
    cannot finish yet still completes, with the file's bytes; the writes then land."""
    src = tmp_path / "moments.bin"
    want = torch.arange(1 << 16, dtype=torch.int32)
    src.write_bytes(want.numpy().tobytes())
    ops = _HeldWrites()
    with IOEngine(block_size=65536, queue_depth=1, thread_count=1, os_ops=ops) as e:
        writes = [e.write(str(tmp_path / f"victim{i}.bin"), torch.ones(1 << 16)) for i in range(3)]
        got = torch.empty_like(want)
        try:
            e.read(str(src), got).result(timeout=10)  # times out when it waits for the writes
            assert torch.equal(got, want)
            assert not any(w.done() for w in writes)
        finally:
            ops.go.set()
        for i, w in enumerate(writes):
            w.result(timeout=10)
            assert (tmp_path / f"victim{i}.bin").read_bytes() == torch.ones(1 << 16).numpy().tobytes()
