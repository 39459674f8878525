"""Conformance suite for the tensor store: round trips checked through zarr and raw bits.

``TensorStoreTests`` creates, writes (whole and in ranges, from threads), reads (whole,
in windows across chunk boundaries) and deletes flat arrays, and checks the results
against the source tensors and against what ``zarr`` itself reads from the same folder.
Subclass it with the store under test (``make_store(root)``; its engine is closed with
it)::

    class TestBufferedStore(TensorStoreTests):
        def make_store(self, root):
            return TensorStore(root, IOEngine(direct=False))

Needs pytest and hypothesis (zeroio's dev extra).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroio.io import ArrayExistsError, ArrayNotFoundError, TensorStore


class TensorStoreTests:
    def make_store(self, root) -> TensorStore:
        raise NotImplementedError("a subclass returns the TensorStore under test")

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make_store(tmp_path / "store")
        yield s
        s.close()
        s.engine.close()

    def test_round_trip_and_zarr_open_reads_it(self, store):
        x = torch.randn(100_003)
        store.create("opt/fp32", x.numel(), torch.float32, chunk_elems=30_000)
        store.write("opt/fp32", x[:45_001]).result()
        store.write("opt/fp32", x[45_001:], 45_001).result()
        assert torch.equal(store.read("opt/fp32").result(), x)
        part = torch.empty(777)
        store.read_into("opt/fp32", part, 29_500).result()  # spans a chunk boundary
        assert torch.equal(part, x[29_500:30_277])
        arr = zarr.open_group(store.root, mode="r")["opt/fp32"]
        assert arr.shape == (100_003,) and arr.chunks == (30_000,)
        np.testing.assert_array_equal(arr[:], x.numpy())
        np.testing.assert_array_equal(
            zarr.open(os.path.join(store.root, "opt", "fp32"), mode="r")[5:9], x[5:9].numpy())

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_16bit_floats_stored_as_raw_bits(self, store, dtype):
        import google_crc32c

        x = torch.randn(5000).to(dtype)
        info = store.create("p", x.numel(), dtype)
        store.write("p", x).result()
        meta = json.loads(open(os.path.join(store.root, "p", "zarr.json")).read())
        assert meta["data_type"] == "uint16"
        assert meta["attributes"]["zeroio"]["torch_dtype"] == str(dtype)[6:]
        raw = open(os.path.join(store.root, "p", "c", "0"), "rb").read()
        bits = x.view(torch.int16).numpy().tobytes()
        assert raw[: len(bits)] == bits  # raw little-endian bits, no conversion
        assert len(raw) == info.chunk_bytes + 4
        assert raw[-4:] == google_crc32c.value(raw[:-4]).to_bytes(4, "little")
        np.testing.assert_array_equal(zarr.open_group(store.root, mode="r")["p"][:],
                                      x.view(torch.int16).numpy().view(np.uint16))
        assert torch.equal(store.read("p").result().view(torch.int16), x.view(torch.int16))

    def test_preallocated_array_reads_zeros_and_is_valid_zarr(self, store):
        store.create("z", 10_000, torch.float32, chunk_elems=4096)
        assert torch.equal(store.read("z").result(), torch.zeros(10_000))
        np.testing.assert_array_equal(zarr.open_group(store.root, mode="r")["z"][:],
                                      np.zeros(10_000, np.float32))

    @settings(max_examples=15, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(numel=st.integers(1, 40_000), chunk=st.integers(512, 9_000), data=st.data())
    def test_range_writes_and_reads_match_a_numpy_model(self, store, numel, chunk, data):
        name = f"h{numel}x{chunk}"
        store.create(name, numel, torch.float32, chunk_elems=chunk)
        model = np.zeros(numel, np.float32)
        for _ in range(data.draw(st.integers(1, 4))):
            a = data.draw(st.integers(0, numel - 1))
            b = data.draw(st.integers(a + 1, numel))
            piece = torch.randn(b - a, generator=torch.Generator().manual_seed(a * 7 + b))
            store.write(name, piece, a).result()
            model[a:b] = piece.numpy()
        a = data.draw(st.integers(0, numel - 1))
        b = data.draw(st.integers(a + 1, numel))
        np.testing.assert_array_equal(store.read(name, a, b - a).result().numpy(), model[a:b])
        np.testing.assert_array_equal(zarr.open_group(store.root, mode="r")[name][:], model)
        store.delete(name)

    def test_concurrent_unaligned_range_writes_threads(self, store):
        n = 50_000
        x = torch.randn(n)
        store.create("r", n, torch.float32, chunk_elems=4096)
        cuts = sorted({0, n, *np.random.default_rng(0).integers(1, n, 40).tolist()})
        futs = [store.write("r", x[a:b], a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        for f in futs:
            f.result(timeout=60)
        assert torch.equal(store.read("r").result(), x)

    def test_create_idempotent_and_conflicts(self, store):
        a = store.create("x", 100, torch.float32)
        assert store.create("x", 100, torch.float32) == a
        with pytest.raises(ArrayExistsError, match="delete"):
            store.create("x", 101, torch.float32)
        assert store.has("x")
        store.delete("x")
        assert not store.has("x")
        with pytest.raises(ArrayNotFoundError):
            store.read("x")
