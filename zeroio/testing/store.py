"""Conformance suites for the tiered store and its NVMe backends (like ``zarr.testing``).

``TieredStoreTests`` is a hypothesis state machine that runs ``TieredStore`` over a
backend against a plain dict; ``NvmeBackendTests`` checks one backend's contract
(zeroio/tiering/backend.py) against the bytes written. A new backend passes both::

    class MyBackendStore(TieredStoreTests):
        def make_backend(self):
            return MyBackend()
    test_my_backend_store = MyBackendStore.TestCase

    class TestMyBackend(NvmeBackendTests):
        def make_backend(self, tmp_path):
            return MyBackend()

Needs pytest and hypothesis (zeroio's dev extra).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zeroio.errors import CapacityError, ResidencyError, SwapIOError
from zeroio.tiering import Tier, TieredStore
from zeroio.tiering.backend import NvmeBackend

PAGE = 4096
"""A CPU copy costs whole pages."""
NAMES = [f"n{i}" for i in range(6)]


def page_cost(nbytes: int) -> int:
    return max(-(-nbytes // PAGE) * PAGE, PAGE)


class TieredStoreTests(RuleBasedStateMachine):
    """TieredStore against a dict of tensors over the backend ``make_backend`` returns.

    Subclass, define ``make_backend``, and expose ``Subclass.TestCase`` to pytest (set its
    ``settings`` for the example count). Each example registers, acquires (for reading and
    for overwrite), writes, releases, prefetches and flushes a handful of small tensors
    under CPU budgets of a few pages, so eviction and write-back run all the time; every
    acquire must return exactly the dict's value, the tiers' used bytes never exceed their
    budgets, and after ``close`` the backend holds no array (and an on-disk one no folder).
    """

    def make_backend(self) -> NvmeBackend:
        raise NotImplementedError("a subclass returns the NvmeBackend under test")

    @initialize(policy=st.sampled_from(["lru", "fifo", "trace"]), cpu_pages=st.integers(2, 5),
                depth=st.integers(0, 2))
    def setup(self, policy, cpu_pages, depth):
        backend = self.make_backend()
        self.cpu_budget = cpu_pages * PAGE
        self.nvme_budget = 6 * PAGE
        self.store = TieredStore(None, backend=backend, policy=policy,
                                 prefetch_depth=depth, cpu_budget_bytes=self.cpu_budget,
                                 nvme_budget_bytes=self.nvme_budget)
        self.backend = backend
        self.model: dict[str, torch.Tensor] = {}
        self.home: dict[str, Tier] = {}
        self.held: dict[str, torch.Tensor] = {}  # name -> tensor acquired in CPU

    @rule(name=st.sampled_from(NAMES), numel=st.integers(1, 1536),
          home=st.sampled_from([Tier.CPU, Tier.NVME, Tier.GPU]), seed=st.integers(0, 1000))
    def register(self, name, numel, home, seed):
        if name in self.model:
            with pytest.raises(ResidencyError):
                self.store.register(name, (numel,), torch.float32, home=home)
            return
        init = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        try:
            placed = self.store.register(name, (numel,), torch.float32, home=home, init=init)
        except CapacityError as exc:
            assert str(numel * 4) in str(exc)  # names the bytes needed
            assert name not in self.store.names
            return
        # No GPU here: a GPU home falls to CPU or NVMe; a CPU home may fall to NVMe.
        assert placed in (Tier.CPU, Tier.NVME)
        assert not (home is Tier.NVME and placed is Tier.CPU)
        self.model[name] = init.clone()
        self.home[name] = placed

    def _cpu_fits(self, name) -> bool:
        """The model's answer: CPU homes plus held NVMe caches plus ``name``'s copy fit."""
        cpu_homes = sum(page_cost(self.model[n].numel() * 4) for n in self.model if self.home[n] is Tier.CPU)
        held_cache = sum(page_cost(self.held[n].numel() * 4) for n in self.held if self.home[n] is Tier.NVME)
        need = 0 if self.home[name] is Tier.CPU else page_cost(self.model[name].numel() * 4)
        return cpu_homes + held_cache + need <= self.cpu_budget

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def acquire_and_read(self, data):
        name = data.draw(st.sampled_from(sorted(self.model)))
        if name in self.held:
            return
        fits = self._cpu_fits(name)
        try:
            t = self.store.acquire(name, "cpu")
        except CapacityError:
            assert not fits, "acquire refused although unpinned space could be freed"
            return
        assert fits, "acquire succeeded beyond the budget"
        torch.testing.assert_close(t, self.model[name], rtol=0, atol=0)
        self.held[name] = t

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 1000))
    def acquire_for_overwrite(self, data, seed):
        """acquire(overwrite=True), then every element written: the store must keep exactly
        the new values (nothing read, nothing older written back over them)."""
        name = data.draw(st.sampled_from(sorted(self.model)))
        if name in self.held:
            return
        fits = self._cpu_fits(name)
        try:
            t = self.store.acquire(name, "cpu", overwrite=True)
        except CapacityError:
            assert not fits, "overwrite acquire refused although unpinned space could be freed"
            return
        assert fits, "overwrite acquire succeeded beyond the budget"
        assert t.shape == self.model[name].shape
        t.copy_(torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed)))
        self.model[name] = t.clone()
        self.held[name] = t

    @precondition(lambda self: self.held)
    @rule(data=st.data(), value=st.floats(-1e3, 1e3, allow_nan=False))
    def write(self, data, value):
        name = data.draw(st.sampled_from(sorted(self.held)))
        t = self.held[name]
        idx = data.draw(st.integers(0, t.numel() - 1))
        t[idx] = value
        t[0] += 1.0
        self.store.mark_dirty(name)
        self.model[name] = t.clone()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        name = data.draw(st.sampled_from(sorted(self.held)))
        self.store.release(name)
        del self.held[name]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def prefetch(self, data):
        names = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=3))
        self.store.prefetch(names, "cpu")

    @rule()
    def step_boundary(self):
        self.store.step_boundary()

    @rule()
    def flush(self):
        self.store.flush()

    @invariant()
    def budgets_hold(self):
        if not hasattr(self, "store"):
            return
        tiers = self.store.stats()["tiers"]
        for tier, info in tiers.items():
            assert info["used_bytes"] <= info["budget_bytes"], (tier, info)
        assert self.store.held_host_bytes() <= self.cpu_budget
        assert self.store.held_host_bytes() == tiers["cpu"]["used_bytes"]

    def teardown(self):
        if not hasattr(self, "store"):
            return
        for name in list(self.held):
            self.store.release(name)
        # Final read-back of everything, then close and check nothing is left.
        for name, want in self.model.items():
            try:
                got = self.store.acquire(name, "cpu")
            except CapacityError:
                continue
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            self.store.release(name)
        self.store.close()
        assert self.store.held_host_bytes() == 0
        assert self.backend.names() == []
        if hasattr(self.backend, "root"):
            assert not os.path.exists(self.backend.root)


class NvmeBackendTests:
    """The NvmeBackend contract; subclass and define ``make_backend(tmp_path)``."""

    def make_backend(self, tmp_path) -> NvmeBackend:
        raise NotImplementedError("a subclass returns the NvmeBackend under test")

    @pytest.fixture
    def backend(self, tmp_path):
        b = self.make_backend(tmp_path)
        yield b
        b.close()

    def test_created_array_reads_zeros(self, backend):
        backend.create("a", 1000, torch.float32)
        out = torch.full((1000,), 7.0)
        backend.read_into("a", out).result()
        assert torch.equal(out, torch.zeros(1000))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                       torch.int64])
    @pytest.mark.parametrize("numel", [1, 4095, 70_001])
    def test_round_trip_is_bit_exact(self, backend, dtype, numel):
        g = torch.Generator().manual_seed(numel)
        x = (torch.randint(0, 255, (numel,), generator=g, dtype=torch.uint8).to(dtype)
             if not dtype.is_floating_point else torch.randn(numel, generator=g).to(dtype))
        backend.create("x", numel, dtype)
        backend.write("x", x).result()
        out = torch.empty_like(x)
        backend.read_into("x", out).result()
        assert out.view(torch.uint8).numpy().tobytes() == x.view(torch.uint8).numpy().tobytes()

    def test_rewrite_replaces_every_byte_and_arrays_are_separate(self, backend):
        a, b = torch.randn(5000), torch.randn(3000)
        backend.create("a", 5000, torch.float32)
        backend.create("b", 3000, torch.float32)
        backend.write("a", torch.ones(5000)).result()
        backend.write("b", b).result()
        backend.write("a", a).result()
        got_a, got_b = torch.empty(5000), torch.empty(3000)
        backend.read_into("a", got_a).result()
        backend.read_into("b", got_b).result()
        assert torch.equal(got_a, a) and torch.equal(got_b, b)

    def test_names_delete_and_close(self, tmp_path):
        backend = self.make_backend(tmp_path)
        for n in ("z", "y", "x"):
            backend.create(n, 10, torch.float32)
        assert backend.names() == ["x", "y", "z"]
        backend.delete("y")
        backend.delete("never-made")  # deleting what is not there is not an error
        assert backend.names() == ["x", "z"]
        backend.close()
        assert backend.names() == []
        if hasattr(backend, "root"):
            assert not os.path.exists(backend.root)

    def test_missing_array_is_a_swap_io_error(self, backend):
        with pytest.raises(SwapIOError):
            backend.read_into("missing", torch.empty(4)).result()
        with pytest.raises(SwapIOError):
            backend.write("missing", torch.empty(4)).result()
