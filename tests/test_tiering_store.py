"""TieredStore: budgets, error cases and stats.

The store-vs-dict state machine is zeroio.testing.store.TieredStoreTests, run for every
backend by tests/test_conformance_tiering.py.
"""

from __future__ import annotations

import pytest
import torch

from zeroio.config.policy import TieringPolicy, resolve_policies
from zeroio.errors import CapacityError, ConfigError, ResidencyError, SwapIOError
from zeroio.testing.disk_model import DiskModel
from zeroio.testing.store import PAGE
from zeroio.tiering import MemoryBackend, Tier, TieredStore

# -- error cases -------------------------------------------------------------


def small_store(**kw) -> TieredStore:
    kw.setdefault("cpu_budget_bytes", 2 * PAGE)
    kw.setdefault("nvme_budget_bytes", 4 * PAGE)
    kw.setdefault("policy", "lru")
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
        s._prefetcher.join()
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


def test_acquire_async_keeps_several_loads_in_flight():
    """A disk that answers a read only once a second one is outstanding: the store must
    start the next asynchronous acquire's load before the previous one lands."""
    import threading

    from zeroio.tiering.backend import MemoryBackend as Mem

    both = threading.Barrier(2, timeout=5)

    class Paired(Mem):
        def _read(self, name, out):
            try:
                both.wait()  # breaks (and the read fails) unless two reads overlap
            except threading.BrokenBarrierError:
                raise SwapIOError(f"read of {name!r} ran alone") from None
            return super()._read(name, out)

    with small_store(backend=Paired(threads=2), cpu_budget_bytes=4 * PAGE) as s:
        for i, n in enumerate(("a", "b")):
            s.register(n, (16,), torch.float32, home=Tier.NVME, init=torch.full((16,), float(i)))
        futures = [s.acquire_async(n, "cpu") for n in ("a", "b")]
        got = [f.result(timeout=10) for f in futures]
        torch.testing.assert_close(got[0], torch.zeros(16))
        torch.testing.assert_close(got[1], torch.ones(16))
        for n in ("a", "b"):
            s.release(n)


def test_clean_data_is_not_written_back():
    with small_store(cpu_budget_bytes=2 * PAGE) as s:
        for n in ("a", "b", "c"):
            s.register(n, (4,), torch.float32, home=Tier.NVME)
        for n in ("a", "b", "c", "a"):
            s.acquire(n, "cpu")
            s.release(n)
        assert "cpu->nvme" not in s.stats()["bytes_moved"]


def test_policy_from_plain_values_and_bad_values():
    with TieredStore(None, backend=MemoryBackend(), policy="fifo", prefetch_depth=3,
                     cpu_budget_bytes=8192) as store:
        assert (store.cfg.policy.value, store.cfg.prefetch_depth) == ("fifo", 3)
        assert store.cfg.gpu_budget_bytes is None and store.stats()["policy"] == "fifo"
    with pytest.raises(ConfigError, match="policy"):
        TieringPolicy(policy="mru")
    with pytest.raises(ConfigError, match="cpu_budget_bytes"):
        TieringPolicy(cpu_budget_bytes=-1)
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        TieredStore(None, backend=MemoryBackend(), bogus=1)
    with pytest.raises(TypeError, match="resolve_policies"):  # a raw block is not read below config
        TieredStore({"policy": "lru"}, backend=MemoryBackend())


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
    tc = resolve_policies(cfg.zero_optimization).tiering
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


# -- unwritten NVMe homes ----------------------------------------------------


def test_first_load_of_an_unwritten_nvme_home_reads_nothing():
    backend = DiskModel()
    with small_store(backend=backend) as s:
        s.register("m", (PAGE // 4,), torch.float32, home=Tier.NVME)
        s.register("w", (PAGE // 4,), torch.float32, home=Tier.NVME, init=torch.full((PAGE // 4,), 3.0))
        t = s.acquire("m", "cpu")
        assert torch.equal(t, torch.zeros(PAGE // 4))
        assert backend.count("read", "m") == 0
        assert s.stats()["bytes_moved"].get("nvme->cpu", 0) == 0  # nothing was read
        t.add_(2.0)
        s.mark_dirty("m", "cpu")
        s.release("m")
        # A tensor registered with init is on the disk: its load reads it.
        assert torch.equal(s.acquire("w", "cpu"), torch.full((PAGE // 4,), 3.0))
        s.release("w")
        assert backend.count("read", "w") == PAGE
        # "m" is written back to its home when it leaves the CPU tier; from then on a load
        # reads the disk and sees the written values, not zeros.
        s.evict("m", "cpu")
        s.drain()
        assert torch.equal(s.acquire("m", "cpu"), torch.full((PAGE // 4,), 2.0))
        s.release("m")
        assert backend.count("read", "m") == PAGE
        # bytes counted: the two reads that reached the disk ("w" once, "m" once)
        assert s.stats()["bytes_moved"]["nvme->cpu"] == 2 * PAGE
