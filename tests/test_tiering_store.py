"""TieredStore against a plain dict of tensors, budgets, leaks and error cases.

The reference is a dict name -> torch.Tensor updated by the same operations;
every acquire must return exactly the dict's value. Budgets are a few 4 KiB
pages (a CPU copy costs whole pages), so eviction and write-back run all the
time. Prefetches run on the store's background thread, so the interleavings
are real.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zeroio.errors import CapacityError, ConfigError, ResidencyError, SwapIOError
from zeroio.tiering import MemoryBackend, Tier, TieredStore, TieringPolicyConfig

PAGE = 4096
NAMES = [f"n{i}" for i in range(6)]


def page_cost(nbytes: int) -> int:
    return max(-(-nbytes // PAGE) * PAGE, PAGE)


class StoreVsDict(RuleBasedStateMachine):
    backend_factory = staticmethod(lambda tmp: (MemoryBackend(), None))

    @initialize(policy=st.sampled_from(["lru", "fifo", "trace"]), cpu_pages=st.integers(2, 5),
                depth=st.integers(0, 2))
    def setup(self, policy, cpu_pages, depth):
        self.tmp = None
        backend, nvme_path = self.backend_factory(None)
        self.cpu_budget = cpu_pages * PAGE
        self.nvme_budget = 6 * PAGE
        self.store = TieredStore(None, backend=backend, nvme_path=nvme_path, policy=policy,
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
        assert self.backend.names() == [] if hasattr(self.backend, "names") else True
        if hasattr(self.backend, "root"):
            assert not os.path.exists(self.backend.root)


StoreVsDict.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_store_behaves_like_a_dict = StoreVsDict.TestCase


class StoreVsDictOnDisk(StoreVsDict):
    """Same machine over the zarr TensorStore on a temporary directory."""

    @staticmethod
    def backend_factory(_):
        import tempfile

        from zeroio.tiering.nvme import TensorStoreBackend

        return TensorStoreBackend(tempfile.mkdtemp(prefix="zeroio-tiering-test-")), None


StoreVsDictOnDisk.TestCase.settings = settings(
    max_examples=12, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_store_behaves_like_a_dict_on_disk = StoreVsDictOnDisk.TestCase


# -- error cases -------------------------------------------------------------


def small_store(**kw) -> TieredStore:
    kw.setdefault("cpu_budget_bytes", 2 * PAGE)
    kw.setdefault("nvme_budget_bytes", 4 * PAGE)
    return TieredStore(None, backend=kw.pop("backend", MemoryBackend()), prefetch_depth=0, **kw)


def test_register_too_large_for_cpu_names_budget_and_bytes():
    with small_store() as s:
        with pytest.raises(CapacityError) as ei:
            s.register("big", (3 * PAGE // 4,), torch.float32, home=Tier.NVME)
        msg = str(ei.value)
        assert "'big'" in msg and str(3 * PAGE) in msg and f"cpu {2 * PAGE}" in msg


def test_register_beyond_total_capacity():
    with small_store() as s:
        for i in range(4):
            s.register(f"t{i}", (PAGE // 4,), torch.float32, home=Tier.NVME)
        s.register("c0", (PAGE // 4,), torch.float32, home=Tier.CPU)  # 1 CPU page + 1 staging page
        with pytest.raises(CapacityError) as ei:
            s.register("t4", (PAGE // 4,), torch.float32, home=Tier.NVME)
        assert f"nvme {4 * PAGE} (homes {4 * PAGE})" in str(ei.value)
        # A CPU home that would leave no staging room for NVMe tensors falls to NVMe: full.
        with pytest.raises(CapacityError):
            s.register("c1", (PAGE // 4,), torch.float32, home=Tier.CPU)


def test_read_error_surfaces_to_acquirer_with_name_and_recovers():
    backend = MemoryBackend()
    with small_store(backend=backend) as s:
        s.register("w", (8,), torch.float32, home=Tier.NVME, init=torch.arange(8.0))
        backend.fail_next("read", "w")
        with pytest.raises(SwapIOError, match="'w'"):
            s.acquire("w", "cpu")
        torch.testing.assert_close(s.acquire("w", "cpu"), torch.arange(8.0))  # retried
        s.release("w")


def test_prefetch_read_error_surfaces_at_next_acquire():
    backend = MemoryBackend()
    with small_store(backend=backend) as s:
        s.register("w", (8,), torch.float32, home=Tier.NVME, init=torch.ones(8))
        backend.fail_next("read", "w")
        s.prefetch(["w"], "cpu")
        s._queue.join()
        s._lock.acquire(); s._mover.quiesce(); s._lock.release()  # noqa: E702
        with pytest.raises(SwapIOError, match="loading 'w'"):
            s.acquire("w", "cpu")
        torch.testing.assert_close(s.acquire("w", "cpu"), torch.ones(8))


def test_writeback_error_keeps_data_and_names_the_tensor():
    backend = MemoryBackend()
    with small_store(backend=backend, cpu_budget_bytes=PAGE) as s:
        for n in ("a", "b"):
            s.register(n, (4,), torch.float32, home=Tier.NVME)
        t = s.acquire("a", "cpu")
        t.fill_(7.0)
        s.mark_dirty("a")
        s.release("a")
        backend.fail_next("write", "a")
        # CPU holds one staging page: acquiring b must evict a, whose write-back fails.
        with pytest.raises(SwapIOError, match="writing back 'a'"):
            s.acquire("b", "cpu")
        torch.testing.assert_close(s.acquire("a", "cpu"), torch.full((4,), 7.0))
        s.release("a")
        s.acquire("b", "cpu")  # now the write-back succeeds
        s.release("b")
        torch.testing.assert_close(s.acquire("a", "cpu"), torch.full((4,), 7.0))


def test_misuse_is_a_residency_error():
    with small_store() as s:
        s.register("x", (4,), torch.float32, home=Tier.NVME)
        with pytest.raises(ResidencyError, match="not acquired"):
            s.release("x", "cpu")
        with pytest.raises(ResidencyError, match="no tensor named 'y'"):
            s.acquire("y", "cpu")
        with pytest.raises(ResidencyError, match="nvme"):
            s.acquire("x", "nvme")
        with pytest.raises(ResidencyError):
            s.mark_dirty("x")
        with pytest.raises(CapacityError, match="gpu tier has a budget of 0"):
            s.acquire("x", "gpu")
    with pytest.raises(ResidencyError, match="closed"):
        s.acquire("x", "cpu")


def test_acquire_with_everything_pinned_is_a_capacity_error():
    with small_store(cpu_budget_bytes=2 * PAGE) as s:
        for n in ("a", "b", "c"):
            s.register(n, (4,), torch.float32, home=Tier.NVME)
        s.acquire("a", "cpu")
        s.acquire("b", "cpu")
        with pytest.raises(CapacityError, match="release tensors first"):
            s.acquire("c", "cpu")


def test_acquire_async_and_stats_shape():
    with small_store() as s:
        s.register("w", (16,), torch.float32, home=Tier.NVME, init=torch.arange(16.0))
        fut = s.acquire_async("w", "cpu")
        torch.testing.assert_close(fut.result(timeout=10), torch.arange(16.0))
        s.release("w")
        st_ = s.stats()
        assert st_["bytes_moved"] == {"nvme->cpu": 64}
        assert st_["misses"] == 1 and st_["hits"] == 0
        assert set(st_["tiers"]) == {"gpu", "cpu", "nvme"}
        assert st_["tiers"]["nvme"]["used_bytes"] == 64


def test_overwrite_reads_nothing_and_its_values_reach_the_home():
    with small_store(cpu_budget_bytes=2 * PAGE) as s:
        s.register("w", (16,), torch.float32, home=Tier.NVME, init=torch.arange(16.0))
        t = s.acquire("w", "cpu", overwrite=True)
        assert s.residency("w") == {"nvme": "clean", "cpu": "dirty"}
        t.copy_(torch.full((16,), 7.0))
        s.release("w")
        st_ = s.stats()
        assert "nvme->cpu" not in st_["bytes_moved"]  # no read of the old bytes
        assert st_["overwrites"] == 1 and st_["misses"] == 0
        s.flush()
        assert s.stats()["bytes_moved"] == {"cpu->nvme": 64}
        for n in ("a", "b"):  # evict w's cache copy, then read the home back
            s.register(n, (1024,), torch.float32, home=Tier.NVME)
            s.acquire(n, "cpu")
            s.release(n)
        assert "cpu" not in s.residency("w")
        torch.testing.assert_close(s.acquire("w", "cpu"), torch.full((16,), 7.0))
        s.release("w")
        # a resident copy is reused (no second allocation) and comes back dirty
        s.acquire("w", "cpu", overwrite=True)
        assert s.residency("w")["cpu"] == "dirty" and s.stats()["hits"] == 1
        s.release("w")


def test_acquire_async_result_wait_counts_as_stall():
    import threading

    from zeroio.tiering.backend import MemoryBackend as Mem

    gate = threading.Event()

    class Slow(Mem):
        def _read(self, name, out):
            gate.wait(5)  # the disk answers only when the test lets it
            return super()._read(name, out)

    with small_store(backend=Slow()) as s:
        s.register("w", (16,), torch.float32, home=Tier.NVME, init=torch.arange(16.0))
        fut = s.acquire_async("w", "cpu")
        threading.Timer(0.2, gate.set).start()
        torch.testing.assert_close(fut.result(timeout=10), torch.arange(16.0))
        st_ = s.stats()
        assert st_["stall_seconds"] >= 0.15, st_
        assert st_["busy_seconds"] >= st_["stall_seconds"] - 0.05
        s.release("w")


def test_clean_data_is_not_written_back():
    with small_store(cpu_budget_bytes=2 * PAGE) as s:
        for n in ("a", "b", "c"):
            s.register(n, (4,), torch.float32, home=Tier.NVME)
        for n in ("a", "b", "c", "a"):
            s.acquire(n, "cpu")
            s.release(n)
        assert "cpu->nvme" not in s.stats()["bytes_moved"]


def test_config_from_plain_values_and_bad_values():
    cfg = TieringPolicyConfig.from_config({"policy": "trace", "prefetch_depth": 3, "cpu_budget_bytes": 8192})
    assert cfg.policy.value == "trace" and cfg.prefetch_depth == 3 and cfg.gpu_budget_bytes is None
    with pytest.raises(ConfigError, match="policy"):
        TieringPolicyConfig(policy="mru")
    with pytest.raises(ConfigError, match="cpu_budget_bytes"):
        TieringPolicyConfig(cpu_budget_bytes=-1)
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        TieringPolicyConfig.from_config({"bogus": 1})


def test_config_from_the_config_layer():
    zeroio_config = pytest.importorskip("zeroio.config")
    cfg = zeroio_config.load_config({
        "train_batch_size": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"},
            "tiering": {"policy": "fifo", "cpu_budget_bytes": 123456},
        },
    })
    tc = TieringPolicyConfig.from_config(cfg)
    assert tc.policy.value == "fifo" and tc.cpu_budget_bytes == 123456 and tc.nvme_path == "/tmp/x"


def test_register_passes_a_cpu_home_to_nvme_when_acquired_copies_fill_the_cpu_tier():
    """Found by the state machine: CPU homes leave room, but copies the caller holds fill
    the tier; the new home must go to NVMe rather than fail (or wait on the caller itself)."""
    store = TieredStore(None, backend=MemoryBackend(), policy="lru", prefetch_depth=0,
                        cpu_budget_bytes=4 * PAGE, nvme_budget_bytes=6 * PAGE)
    try:
        assert store.register("n0", (1,), torch.float32, home=Tier.CPU) is Tier.CPU
        assert store.register("n2", (1025,), torch.float32, home=Tier.NVME) is Tier.NVME
        assert store.register("n3", (1,), torch.float32, home=Tier.NVME) is Tier.NVME
        store.acquire("n2", "cpu")  # 2 pages
        store.acquire("n3", "cpu")  # 1 page: with n0's page the tier is full
        init = torch.arange(5, dtype=torch.float32)
        assert store.register("n1", (5,), torch.float32, home=Tier.CPU, init=init) is Tier.NVME
        store.release("n2")
        store.release("n3")
        torch.testing.assert_close(store.acquire("n1", "cpu"), init, rtol=0, atol=0)
        store.release("n1")
    finally:
        store.close()
