"""Stage 3 with offload_param nvme: what each rank holds, and parameter buffers of one shard.

1. What each rank holds (after init and between steps), measured from outside
   the code under test:
   - host memory: every live CPU tensor of the process (``gc``) is scanned for
     the bytes of this rank's parameter shards (bf16, so the fp32 masters and
     gradients cannot match by accident); the shards found on CPU must fit in
     the configured buffers (``buffer_count * buffer_size`` 16-bit elements),
     so no shard stays on CPU beyond them. A positive control inside
     ``GatheredParameters`` shows the scan does find shards when they are there.
   - disk: the bytes of the rank's NVMe swap files are its shards, about
     1/world of the model's 16-bit bytes.
   - the tiered store's own view (residency per tensor, CPU tier use) agrees.
3. ``offload_param.max_in_cpu`` = half the shard elements (7-layer Llama, 2 ranks):
   the shards the store homes in CPU are found in live CPU tensors, they are
   between half minus one shard and half of the bytes, NVMe writes per step
   (``engine.stats()``) drop by exactly their bytes and reads by at least as
   much, and training still matches torch AdamW.
2. Buffers that hold a single largest shard (far below the ~3 shards the
   store needed before): the prefetch of upcoming groups waits or is dropped
   instead of failing, and 2-rank training still matches torch AdamW.
4. offload_param cpu + offload_optimizer cpu, the host step of
   [Note: stage-3 host step] (1, 2 ranks; persistent biases and sharded weights):
   with ``ZEROIO_OVERLAP_STEP=1`` ``step()`` returns before the worker ran its
   first Adam chunk (each chunk is slowed down), yet losses and parameters match
   torch AdamW + clip_grad_norm_, parameters read through ``GatheredParameters``
   right after ``step()`` (no ``synchronize``) are the updated ones, and every
   value equals the non-overlapped run's exactly; a control run with the
   gathers' wait removed reads stale parameters (the test can fail).
"""

from __future__ import annotations

import gc
import os

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)

from zeroio.testing import run_ranks
from zeroio.testing.models import llama_reference, mlp_batch, mlp_reference, tiny_llama, tiny_mlp
from zeroio.testing.training import (
    gather_state,
    gathered_params,
    reference_diffs,
    train_llama,
    train_steps,
)


def _shard_needles(engine) -> dict[int, bytes]:
    """This rank's 16-bit shard of every flat group, as bytes, from gathered parameters."""
    import torch

    import zeroio

    part = engine.partitioner
    params = list(engine.module.parameters())
    out = {}
    with zeroio.zero.GatheredParameters(params):
        for g in part.pgroups:
            flat = torch.zeros(g.plan.padded_numel, dtype=part.dtype)
            for slot, p in zip(g.plan.slots, g.params, strict=True):
                flat[slot.offset:slot.offset + slot.numel] = p.detach().reshape(-1)
            shard = flat[g.shard_lo:g.shard_lo + g.plan.shard_numel]
            out[g.plan.index] = shard.view(torch.uint8).numpy().tobytes()
        control = _cpu_shards(out)  # gathered: every shard is on CPU now
    return out, control


def _cpu_storages():
    """Bytes of every distinct CPU storage behind a live tensor of this process."""
    import warnings

    import torch

    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module objects warns
        objects = gc.get_objects()
    for obj in objects:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                    continue
            st = obj.untyped_storage()
            st.data_ptr()
        except Exception:  # noqa: BLE001 - no storage (meta, sparse) or fake (torch.compile's)
            continue
        key = (st.data_ptr(), st.nbytes())
        if key not in seen and st.nbytes():
            raw = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),))
            seen[key] = raw.numpy().tobytes()
    return seen


def _cpu_shards(needles: dict[int, bytes]) -> set[int]:
    """Groups whose whole shard appears in some live CPU tensor's storage."""
    storages = _cpu_storages()
    return {gi for gi, nd in needles.items() if any(nd in b for b in storages.values())}


def _disk_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files if f != "zarr.json")
    return total


def _holds_body(tmpdir):
    import torch
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    nvme = os.path.join(tmpdir, f"r{rank}")
    cfg = eq._config("nvme", "cpu", "bf16", nvme, 0)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=3100,
                                                      max_in_cpu=0)  # DeepSpeed's default 1e9
    budget = 2 * 3100 * 2
    model = tiny_llama()
    model.load_state_dict(init)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    model_bytes = sum(v.numel() * 2 for k, v in init.items() if k != "lm_head.weight")  # tied
    store = engine.partitioner.store.store
    batches = eq._batches(world)
    out = {"budget": budget, "model_bytes": model_bytes, "world": world, "checks": []}

    def measure(when):
        needles, control = _shard_needles(engine)
        gc.collect()
        found = _cpu_shards(needles)
        cpu_named = [n for n in store.names if "cpu" in store.residency(n)]
        out["checks"].append(dict(
            when=when, found_bytes=sum(len(needles[g]) for g in found), found=sorted(found),
            control=len(control) == len(needles), shard_bytes=sum(len(b) for b in needles.values()),
            disk=_disk_bytes(os.path.join(nvme, "param")),
            store_cpu=store.stats()["tiers"]["cpu"]["used_bytes"], cpu_named=len(cpu_named),
            largest=max(len(b) for b in needles.values())))

    measure("init")
    for i, step in enumerate(batches[:3]):
        for ids in step:
            loss = engine(input_ids=ids[rank], labels=ids[rank]).loss
            engine.backward(loss)
            engine.step()
        measure(f"step {i}")
    out["moved"] = store.stats()["bytes_moved"].get("nvme->cpu", 0)
    engine.close()
    return out


def test_each_rank_holds_its_shards_on_nvme_and_at_most_the_buffers_on_cpu(tmp_path):
    for r in run_ranks(_holds_body, 2, str(tmp_path), timeout=300):
        assert r["moved"] > 0  # the shards really came through the buffers from disk
        for c in r["checks"]:
            assert c["control"], c  # the scan finds shards when they are on CPU
            assert c["found_bytes"] <= r["budget"], c  # never more on CPU than the buffers
            assert c["store_cpu"] <= r["budget"] and c["cpu_named"] <= 1, c
            # this rank's shards are ~1/world of the model's 16-bit bytes (padding: < 1 KiB)
            assert abs(c["shard_bytes"] - r["model_bytes"] / r["world"]) < 1024, (c, r)
            # ... and they live on disk: the swap files hold them (chunks round up to 4 KiB)
            assert c["shard_bytes"] <= c["disk"] <= c["shard_bytes"] + 8 * 4096, c
            assert c["largest"] <= r["budget"] < 2 * c["largest"], c  # room for one shard only


def _small_buffer_body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    init, batches, ref_losses, ref_params = eq._start(world)
    results = []
    # one layer shard at world 2 is 4640 elements: 18560 bytes in fp32 (5 pages of 4 KiB),
    # 9280 in bf16 (3 pages); the buffers below hold exactly one of them
    for i, (dtype, off_opt, size) in enumerate((("fp32", "none", 5200), ("bf16", "nvme", 3100))):
        cfg = eq._config("nvme", off_opt, dtype, os.path.join(tmpdir, f"c{i}-r{rank}"), 0)
        cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=size,
                                                          max_in_cpu=0)
        losses, params, masters, _ = train_llama(batches, init, cfg)
        results.append(dict(case=("nvme", off_opt, dtype, 0), **reference_diffs(
            losses, params, masters, ref_losses, ref_params, init, dtype)))
    return results


def test_buffers_of_one_shard_train_like_adamw(tmp_path):
    eq._check(run_ranks(_small_buffer_body, 2, str(tmp_path), timeout=300))


# -- offload_param.max_in_cpu: part of the shards stays in host memory ---------------------------

LAYERS_HALF = 7  # layer shards of 4640 elements at world 2: the greedy choice gets near half


def _max_in_cpu_run(tmpdir, init, batches, max_in_cpu):
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    cfg = eq._config("nvme", "cpu", "bf16", os.path.join(tmpdir, f"m{max_in_cpu}-r{rank}"), 0)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=3100,
                                                      max_in_cpu=max_in_cpu)
    model = tiny_llama(layers=LAYERS_HALF)
    model.load_state_dict(init)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    steps = []
    losses = train_steps(engine, batches,
                         after_step=lambda: steps.append(engine.stats()["last_step"]["bytes_moved"]))
    needles, _ = _shard_needles(engine)
    gc.collect()
    storages = _cpu_storages()
    # groups whose whole bf16 shard is in some live CPU tensor (resident, or in a swap buffer)
    on_cpu = {gi for gi, nd in needles.items() if any(nd in b for b in storages.values())}
    tiers = engine.stats()["tiers"]
    full = gathered_params(engine)
    masters = gather_state(engine)
    store = engine.partitioner.store.store
    homes = {gi: store.home_of(f"stage3.param.{gi}").value for gi in needles}
    engine.close()
    return dict(losses=losses, steps=steps, on_cpu=sorted(on_cpu), homes=homes,
                shard_bytes={gi: len(nd) for gi, nd in needles.items()},
                cpu_used=tiers["cpu"]["used_bytes"], full=full, masters=masters)


def _max_in_cpu_body(tmpdir):
    import torch

    torch.manual_seed(0)
    init = {k: v.clone() for k, v in tiny_llama(layers=LAYERS_HALF).state_dict().items()}
    batches = eq._batches(2)
    ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP,
                                             layers=LAYERS_HALF)
    none = _max_in_cpu_run(tmpdir, init, batches, 0)
    half_numel = sum(none["shard_bytes"].values()) // 2 // 2  # bf16: 2 bytes per element
    half = _max_in_cpu_run(tmpdir, init, batches, half_numel)
    check = dict(case=("nvme", "cpu", "bf16", 0), **reference_diffs(
        half["losses"], half["full"], half["masters"], ref_losses, ref_params, init, "bf16"))
    for r in (none, half):
        del r["full"], r["masters"]
    return dict(none=none, half=half, half_numel=half_numel, check=check)


def test_max_in_cpu_keeps_about_half_on_cpu_and_halves_nvme_traffic(tmp_path):
    results = run_ranks(_max_in_cpu_body, 2, str(tmp_path), timeout=600)
    eq._check([[r["check"]] for r in results])  # still trains like torch AdamW
    for r in results:
        none, half = r["none"], r["half"]
        sizes = half["shard_bytes"]
        total, largest, limit = sum(sizes.values()), max(sizes.values()), 2 * r["half_numel"]
        resident = {gi for gi, h in half["homes"].items() if h == "cpu"}
        resident_bytes = sum(sizes[gi] for gi in resident)
        # the store's view: nothing resident without max_in_cpu; with it, between half minus one
        # shard (greedy: a shard left out did not fit in what was left) and half
        assert all(h == "nvme" for h in none["homes"].values()), none["homes"]
        assert limit - largest < resident_bytes <= limit, (resident_bytes, limit, largest)
        assert 0.35 * total < resident_bytes <= 0.5 * total, (resident_bytes, total)
        # measured from outside: every resident shard's bytes are in a live CPU tensor at the
        # end of training (not only the one a swap buffer may hold), and CPU use covers them
        assert resident <= set(half["on_cpu"]), (resident, half["on_cpu"])
        assert len(set(none["on_cpu"])) <= 1, none["on_cpu"]  # the buffer holds one shard
        assert half["cpu_used"] >= resident_bytes
        # NVMe traffic per step (engine.stats()): each updated shard on NVMe is written once a
        # step (steady state, as in test_stats), so writes drop by exactly the resident bytes;
        # reads drop at least as much (forward and backward read every NVMe shard)
        for s0, s1 in zip(none["steps"][1:], half["steps"][1:], strict=True):
            assert s0["cpu->nvme"] == total, s0
            assert s1["cpu->nvme"] == total - resident_bytes, (s1, resident_bytes)
            assert s1.get("nvme->cpu", 0) >= total - resident_bytes, s1
            assert s0["nvme->cpu"] - s1.get("nvme->cpu", 0) >= resident_bytes, (s0, s1)


# -- 4. the host step, overlapped with the next forward ------------------------------------------

HS_STEPS, HS_LR, HS_CLIP = 3, 1e-2, 0.5


def _hs_train(overlap: bool, gated: bool):
    import threading
    import time

    import torch
    import torch.distributed as dist

    import zeroio
    from zeroio.optim.adam import ShardedAdam

    os.environ["ZEROIO_OVERLAP_STEP"] = "1" if overlap else "0"
    os.environ["ZEROIO_STEP_CHUNK_NUMEL"] = "40"  # several chunks per weight shard
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1,
           "gradient_clipping": HS_CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": HS_LR, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20,
                                 "stage3_prefetch_bucket_size": 300,
                                 "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    part = engine.partitioner
    if not gated:  # control: gathers no longer wait for the step
        for g in part.pgroups:
            g.before_fetch = None
    released = threading.Event()
    log = {"returned_first": 0, "worker_chunks": 0}
    begin = ShardedAdam.begin_chunked_step

    def slow_begin(self, grad_scale=1.0):
        chunked = begin(self, grad_scale)
        update = chunked.update

        def slow_update(gi, lo, k, **kw):
            if threading.current_thread() is not threading.main_thread():
                if overlap and log["worker_chunks"] == 0 and released.wait(timeout=30):
                    log["returned_first"] += 1  # step() returned before this chunk ran
                log["worker_chunks"] += 1
                time.sleep(0.01)
            update(gi, lo, k, **kw)

        chunked.update = slow_update
        return chunked

    ShardedAdam.begin_chunked_step = slow_begin
    try:
        losses, at_return = [], []
        for step in range(HS_STEPS):
            x, y = mlp_batch(step, rank)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            released.clear()
            log["worker_chunks"] = 0
            engine.step()
            at_return.append(log["worker_chunks"])
            released.set()
            losses.append(loss.item())
        params = list(engine.module.parameters())
        with zeroio.zero.GatheredParameters(params):  # right after step(): must wait per group
            gathered = [p.detach().reshape(-1).tolist() for p in params]
        engine.synchronize()
        masters = [engine.optimizer.local_tensor(g.group_index, "fp32").tolist()
                   for g in part.groups]
        chunks = log["worker_chunks"]
        engine.close()
    finally:
        ShardedAdam.begin_chunked_step = begin
    return dict(losses=losses, gathered=gathered, masters=masters,
                returned_first=log["returned_first"], worker_chunks=chunks, at_return=at_return)


def _hs_body():
    return dict(overlap=_hs_train(True, True), plain=_hs_train(False, True))


@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_host_step_matches_adamw_and_the_plain_step(world):
    import torch

    results = run_ranks(_hs_body, world)
    ref_losses, ref_params = mlp_reference(world, HS_STEPS, lr=HS_LR, clip=HS_CLIP)
    for rank, r in enumerate(results):
        ov, plain = r["overlap"], r["plain"]
        assert ov["returned_first"] == HS_STEPS, "step() waited for the CPU optimizer"
        assert ov["worker_chunks"] > 3  # the weights went through the worker, in chunks
        assert ov["at_return"] == [0] * HS_STEPS
        # without overlap step() returns once the worker ran every chunk
        assert plain["at_return"] == [plain["worker_chunks"]] * HS_STEPS
        for step in range(HS_STEPS):
            assert ov["losses"][step] == pytest.approx(ref_losses[step][rank], rel=1e-5,
                                                       abs=1e-6)
        for p, q in zip(ov["gathered"], ref_params, strict=True):
            torch.testing.assert_close(torch.tensor(p), q.reshape(-1), rtol=1e-5, atol=1e-6)
        assert ov["losses"] == plain["losses"]
        assert ov["gathered"] == plain["gathered"]
        assert ov["masters"] == plain["masters"]


def _hs_control_body():
    return _hs_train(True, False)


def test_without_the_gathers_wait_the_next_forward_reads_stale_parameters():
    results = run_ranks(_hs_control_body, 1)
    ref_losses, _ = mlp_reference(1, HS_STEPS, lr=HS_LR, clip=HS_CLIP)
    losses = results[0]["losses"]
    assert any(abs(a - b[0]) > 1e-4 for a, b in zip(losses[1:], ref_losses[1:], strict=True))


def test_step_chunk_key_and_env_override(monkeypatch):
    """``zero_optimization.tiering.step_chunk_numel`` reaches the stage-3 settings;
    ``ZEROIO_STEP_CHUNK_NUMEL`` replaces it when the config is loaded; a bad value is an
    error naming the variable."""
    from zeroio.config import load_config
    from zeroio.errors import ConfigError
    from zeroio.partition.stage3.settings import Stage3Settings

    def chunk(**tiering):
        zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "tiering": tiering}}, world_size=1).zero_optimization
        return Stage3Settings.from_zero_config(zero).step_chunk_numel

    monkeypatch.delenv("ZEROIO_STEP_CHUNK_NUMEL", raising=False)
    assert chunk() == 1 << 26 and chunk(step_chunk_numel=1000) == 1000
    monkeypatch.setenv("ZEROIO_STEP_CHUNK_NUMEL", "4096")
    assert chunk(step_chunk_numel=1000) == 4096
    for bad in ("lots", "0"):
        monkeypatch.setenv("ZEROIO_STEP_CHUNK_NUMEL", bad)
        with pytest.raises(ConfigError) as err:
            chunk()
        assert err.value.key == "ZEROIO_STEP_CHUNK_NUMEL"


def test_overlap_step_from_config_and_env_override(monkeypatch):
    from zeroio.config import load_config
    from zeroio.partition.stage3.settings import Stage3Settings

    def overlap(tiering):
        zero = load_config({"train_micro_batch_size_per_gpu": 1,
                            "zero_optimization": {"stage": 3, "tiering": tiering}},
                           world_size=1).zero_optimization
        return Stage3Settings.from_zero_config(zero).overlap_step

    monkeypatch.delenv("ZEROIO_OVERLAP_STEP", raising=False)
    assert overlap({"overlap_step": True}) and not overlap({})
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "0")
    assert not overlap({"overlap_step": True})
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "1")
    assert overlap({})
