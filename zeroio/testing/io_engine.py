"""Conformance suite for the I/O engine: round trips against the raw bytes of the file.

``IOEngineTests`` writes and reads tensors of many sizes, at many offsets, from aligned
and unaligned memory, whole and in part, and compares every result with the file's own
bytes (read with plain ``open``), never with another engine call. Subclass it with the
engine (or engine settings) under test::

    class TestBufferedEngine(IOEngineTests):
        def make_engine(self):
            return IOEngine(direct=False)

Needs pytest and hypothesis (zeroio's dev extra).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroio.errors import IntegrityError
from zeroio.io import AlignedBuffer, IOEngine

_SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture,  # tmp_path is shared by the examples: names differ
    HealthCheck.differing_executors])  # each subclass runs the same method on its own engine


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8))


class IOEngineTests:
    def make_engine(self) -> IOEngine:
        raise NotImplementedError("a subclass returns the IOEngine under test")

    @pytest.fixture
    def engine(self):
        e = self.make_engine()
        yield e
        e.close()

    @_SETTINGS
    @given(n=st.one_of(st.integers(1, 5000), st.integers(4096, 3 << 20)),
           offset=st.one_of(st.just(0), st.integers(0, 20000),
                            st.integers(0, 8).map(lambda k: k * 4096)),
           unaligned_mem=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def test_round_trip_random_sizes(self, engine, tmp_path, n, offset, unaligned_mem, seed):
        path = tmp_path / f"rt_{n}_{offset}"
        data = rand_bytes(n, seed)
        src = data
        if not unaligned_mem:  # also exercise the zero-copy aligned path
            buf = AlignedBuffer(n, pin=False)
            buf.tensor.copy_(data)
            src = buf.tensor
        assert engine.write(path, src, offset).result() == n
        raw = path.read_bytes()
        assert len(raw) == offset + n
        assert raw[offset:] == data.numpy().tobytes()  # independent reference: the file itself
        out = torch.full((n + 1,), 7, dtype=torch.uint8)[1:]  # unaligned destination
        engine.read(path, out, offset).result()
        assert torch.equal(out, data)

    @_SETTINGS
    @given(size=st.integers(1, 1 << 20), data=st.data(), seed=st.integers(0, 2**32 - 1))
    def test_partial_reads_match_the_file(self, engine, tmp_path, size, data, seed):
        """A file written with plain ``open``; reads of any window return its bytes."""
        path = tmp_path / f"pr_{size}"
        raw = rand_bytes(size, seed).numpy().tobytes()
        path.write_bytes(raw)
        for _ in range(3):
            start = data.draw(st.integers(0, size - 1))
            length = data.draw(st.integers(1, size - start))
            out = torch.empty(length, dtype=torch.uint8)
            engine.read(path, out, start).result()
            assert out.numpy().tobytes() == raw[start:start + length]

    @_SETTINGS
    @given(writes=st.lists(st.tuples(st.integers(0, 300_000), st.integers(1, 70_000),
                                     st.integers(0, 2**32 - 1)), min_size=1, max_size=6))
    def test_overlapping_writes_leave_the_bytes_a_bytearray_would(self, engine, tmp_path, writes):
        path = tmp_path / f"ow_{abs(hash(tuple(writes)))}"
        model = bytearray()
        for offset, n, seed in writes:  # one after the other: the last write wins
            chunk = rand_bytes(n, seed)
            engine.write(path, chunk, offset).result()
            if len(model) < offset + n:
                model.extend(bytes(offset + n - len(model)))
            model[offset:offset + n] = chunk.numpy().tobytes()
        assert path.read_bytes() == bytes(model)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
    def test_dtypes_written_as_raw_bytes(self, engine, tmp_path, dtype):
        x = torch.randn(1001).to(dtype) if dtype.is_floating_point else torch.arange(-500, 501)
        engine.write(tmp_path / "b", x).result()
        assert (tmp_path / "b").read_bytes() == x.view(torch.uint8).numpy().tobytes()
        y = torch.empty_like(x)
        engine.read(tmp_path / "b", y).result()
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    def test_many_concurrent_requests(self, engine, tmp_path):
        sizes = [1 + (i * 7919) % 300_000 for i in range(64)]
        datas = [rand_bytes(s, i) for i, s in enumerate(sizes)]
        shared = tmp_path / "shared"
        offsets = np.cumsum([0] + sizes[:-1]).tolist()
        futs = [engine.write(shared, d, o) for d, o in zip(datas, offsets, strict=True)]
        futs += [engine.write(tmp_path / f"own{i}", d) for i, d in enumerate(datas)]
        for f in futs:
            f.result(timeout=60)
        outs = [torch.empty_like(d) for d in datas]
        reads = [engine.read(shared, o_, off) for o_, off in zip(outs, offsets, strict=True)]
        outs2 = [torch.empty_like(d) for d in datas]
        reads += [engine.read(tmp_path / f"own{i}", o_) for i, o_ in enumerate(outs2)]
        for f in reads:
            f.result(timeout=60)
        assert shared.read_bytes() == b"".join(d.numpy().tobytes() for d in datas)
        for d, a, b in zip(datas, outs, outs2, strict=True):
            assert torch.equal(d, a) and torch.equal(d, b)

    def test_short_read_is_integrity_error(self, engine, tmp_path):
        (tmp_path / "short").write_bytes(b"x" * 10_000)
        out = torch.empty(20_000, dtype=torch.uint8)
        with pytest.raises(IntegrityError, match="short read"):
            engine.read(tmp_path / "short", out).result()
