"""Stage 3 with ``zero_optimization.tiering.params_from_master``: no 16-bit shard, the gather
casts the master ([Note: shards read from the master] in partition/stage3/master_store.py).

1. Training with it on equals training with it off bit for bit (every step's loss, the
   parameters ``GatheredParameters`` shows, the fp32 masters) on a tiny tied Llama with
   gradient checkpointing and clipping: offload_optimizer cpu / nvme / ratio 0.5, bf16
   and fp32 compute, persistent parameters, offload_param nvme (the persistent ones stay in
   its NVMe store), 1 and 2 gloo ranks. The on runs must really
   use ``MasterShards`` with attached groups (else the test would compare off with off).
2. A checkpoint saved with it on is the same bytes as one saved with it off (every file
   of the tag folder read raw), and resuming either across on/off continues exactly as an
   uninterrupted run.
3. The host memory the 16-bit shards held is gone: ``engine.stats()["tiers"]["cpu"]``
   (offload_param cpu) is 2 bytes x the attached shards' elements lower, the store's
   ``resident_bytes`` and a scan of the partitioner's held tensors agree.
4. Config: "auto" resolution (off with offload_param nvme; true turns it on there), and a
   ConfigError naming the key where it cannot apply.
5. A ``GatheredParameters`` modifier's write reaches the masters the gathers read.
"""

from __future__ import annotations

import os

import pytest

from zeroio.testing import run_ranks
from zeroio.testing.models import (
    SMALL_STAGE3,
    offload_optimizer,
    offload_param,
    stage3_config,
    tiny_llama,
    token_batches,
)
from zeroio.testing.training import train_llama

STEPS, GAS, MICRO, LR, CLIP = 3, 2, 2, 1e-3, 0.05


def _config(off_param, off_opt, dtype, nvme_dir, *, on, ratio=None, persistence=0):
    tiering = {"params_from_master": on}
    return stage3_config(micro=MICRO, gas=GAS, clip=CLIP, lr=LR, zero=dict(
        SMALL_STAGE3, stage3_param_persistence_threshold=persistence, tiering=tiering,
        offload_param=offload_param(off_param, nvme_dir),
        offload_optimizer=offload_optimizer(off_opt, nvme_dir, ratio)),
        bf16={"enabled": dtype == "bf16"})


def _init():
    import torch

    torch.manual_seed(0)
    return {k: v.clone() for k, v in tiny_llama().state_dict().items()}


def _bytes(tensors: dict) -> dict:
    return {k: v.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
            for k, v in tensors.items()}


def _store_kind(engine):
    from zeroio.partition.stage3.master_store import MasterShards

    store = engine.partitioner.store
    if not isinstance(store, MasterShards):
        return (type(store).__name__, 0)
    return ("MasterShards", sum(store.attached(g.plan.index) for g in engine.partitioner.pgroups))


CASES = {
    1: [("cpu", "cpu", "bf16", None, 0), ("cpu", "nvme", "bf16", None, 0),
        ("none", "cpu", "bf16", 0.5, 0), ("none", "none", "fp32", None, 0),
        ("nvme", "nvme", "bf16", None, 100)],
    2: [("cpu", "cpu", "bf16", None, 100), ("cpu", "nvme", "bf16", None, 0),
        ("cpu", "cpu", "fp32", 0.5, 0)],
}


def _train_body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    init = _init()
    batches = token_batches(world, steps=STEPS, gas=GAS, micro=MICRO)
    out = []
    for i, (op, oo, dtype, ratio, persist) in enumerate(CASES[world]):
        runs = {}
        for on in (False, True):
            nvme_dir = os.path.join(tmpdir, f"c{i}-{on}-r{rank}")
            cfg = _config(op, oo, dtype, nvme_dir, on=on, ratio=ratio, persistence=persist)
            losses, params, masters, kind = train_llama(batches, init, cfg, inspect=_store_kind)
            runs[on] = (losses, _bytes(params), _bytes(masters), kind)
        out.append(((op, oo, dtype, ratio, persist), runs))
    return out


def _check_training(results):
    for rank_results in results:
        for case, runs in rank_results:
            off, on = runs[False], runs[True]
            assert off[3][0] != "MasterShards", case
            assert on[3][0] == "MasterShards" and on[3][1] > 0, (case, on[3])
            assert on[0] == off[0], (case, on[0], off[0])  # losses, exactly
            assert on[1] == off[1], case  # gathered 16-bit parameters, byte for byte
            assert on[2] == off[2], case  # fp32 masters, byte for byte
            assert len(set(on[0])) == len(on[0]), case  # it trained: the loss moved


def test_training_equal_world_1(tmp_path):
    _check_training(run_ranks(_train_body, 1, str(tmp_path), timeout=300))


def test_training_equal_world_2(tmp_path):
    _check_training(run_ranks(_train_body, 2, str(tmp_path), timeout=300))


def _engine(cfg, init):
    import torch

    import zeroio

    torch.manual_seed(1)  # the checkpoints hold the RNG state: the same in both runs
    model = tiny_llama()
    model.load_state_dict(init)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    return engine


def _tag_bytes(folder: str) -> dict[str, bytes]:
    """Every file under a checkpoint folder, raw; but the manifest, whose creation time and
    the checksum over it are the values two saves of the same state differ in: its JSON
    without those two keys."""
    import json

    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                data = fh.read()
            if f == "manifest.json":
                doc = json.loads(data)
                assert doc.pop("created_unix") and doc.pop("manifest_crc32c")
                data = json.dumps(doc, sort_keys=True).encode()
            out[os.path.relpath(path, folder)] = data
    return out


def _checkpoint_body(tmpdir):
    import torch.distributed as dist

    from zeroio.partition import collectives
    from zeroio.testing.training import gathered_params, train_steps

    world, rank = dist.get_world_size(), dist.get_rank()
    init = _init()
    batches = token_batches(world, steps=4, gas=GAS, micro=MICRO)
    files, resumed = {}, {}

    def cfg(on, name):
        return _config("cpu", "cpu", "bf16", os.path.join(tmpdir, f"{name}-r{rank}"), on=on)

    for on in (False, True):
        e = _engine(cfg(on, f"save{on}"), init)
        train_steps(e, batches[:2])
        e.save_checkpoint(os.path.join(tmpdir, f"ck{on}"), tag="t")
        full = train_steps(e, batches[2:]), _bytes(gathered_params(e))
        e.close()
        collectives.barrier()
        files[on] = _tag_bytes(os.path.join(tmpdir, f"ck{on}"))
        resumed[("straight", on)] = full
    for saved in (False, True):
        e = _engine(cfg(not saved, f"load{saved}"), init)
        e.load_checkpoint(os.path.join(tmpdir, f"ck{saved}"), tag="t")
        resumed[(saved, not saved)] = train_steps(e, batches[2:]), _bytes(gathered_params(e))
        e.close()
    return files, resumed


def test_checkpoint_bytes_and_resume_across(tmp_path):
    for files, resumed in run_ranks(_checkpoint_body, 2, str(tmp_path), timeout=300):
        off, on = files[False], files[True]
        assert off and sorted(off) == sorted(on)
        assert any(k.endswith(".json") for k in off) and len(off) > 3
        diff = [k for k in off if off[k] != on[k]]
        assert not diff, diff
        ref = resumed[("straight", False)]
        assert resumed[("straight", True)] == ref
        assert resumed[(False, True)] == ref  # saved off, resumed on
        assert resumed[(True, False)] == ref  # saved on, resumed off


def _nvme_homes(store):
    """Bytes homed on NVMe by the parameter store (its tiered store's), or 0 without one."""
    from zeroio.partition.stage3.master_store import MasterShards

    inner = store.inner if isinstance(store, MasterShards) else store
    tiered = getattr(inner, "store", None)
    return tiered.stats()["tiers"]["nvme"]["home_bytes"] if tiered is not None else 0


def _memory_body(tmpdir, off_param="cpu"):
    import torch

    from zeroio.partition.stage3.state import GroupState
    from zeroio.tiering import stats as tstats

    init = _init()
    out = {}
    for on in (False, True):
        cfg = _config(off_param, "cpu" if off_param == "cpu" else "nvme",
                      "bf16", os.path.join(tmpdir, f"m-{on}"), on=on, persistence=100)
        if off_param == "nvme":  # no shard resident in host memory: every one homed on NVMe
            cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
        e = _engine(cfg, init)
        from zeroio.testing.training import train_steps

        train_steps(e, token_batches(1, steps=1, gas=1, micro=MICRO))
        part = e.partitioner
        shard_elems = sum(g.plan.shard_numel for g in part.pgroups if not g.plan.persistent)
        persistent = sum(g.plan.shard_numel for g in part.pgroups if g.plan.persistent)
        bf16_held = sum(t.numel() * t.element_size() for t in part.held_tensors()
                        if t.dtype == torch.bfloat16 and t.device.type == "cpu")
        gathered = sum(g.full_flat().numel() * 2 for g in part.pgroups
                       if g.state is not GroupState.SHARDED)
        out[on] = dict(cpu=e.stats()["tiers"]["cpu"]["used_bytes"],
                       store=part.store.resident_bytes().get("cpu", 0),
                       held=tstats.held_bytes(part.held_tensors()).get("cpu", 0),
                       bf16_shards=bf16_held - gathered,
                       shard_elems=shard_elems, persistent=persistent,
                       places=part.store.resident_bytes(),
                       nvme_homes=_nvme_homes(part.store))
        e.close()
    return out


def test_host_memory_of_the_shards_is_gone(tmp_path):
    (r,) = run_ranks(_memory_body, 1, str(tmp_path), timeout=200)
    off, on = r[False], r[True]
    n, p = off["shard_elems"], off["persistent"]
    assert n > 0 and p > 0
    assert off["cpu"] - on["cpu"] == 2 * n, (off, on)
    assert off["held"] - on["held"] == 2 * n, (off, on)
    assert off["store"] == 2 * (n + p) and on["store"] == 2 * p, (off, on)
    assert off["bf16_shards"] == 2 * (n + p) and on["bf16_shards"] == 2 * p, (off, on)


def test_offload_param_nvme_with_it_on_homes_only_the_persistent_shards(tmp_path):
    """``true`` with offload_param nvme: the sharded groups' 16-bit shards have no NVMe home
    (2 bytes an element gone from the disk), the persistent ones stay in the NVMe store."""
    (r,) = run_ranks(_memory_body, 1, str(tmp_path), "nvme", timeout=200)
    off, on = r[False], r[True]
    n, p = off["shard_elems"], off["persistent"]
    assert n > 0 and p > 0
    assert off["nvme_homes"] == 2 * (n + p), off  # every bf16 shard homed on the disk
    assert on["nvme_homes"] == 2 * p, on  # only the persistent ones

def _zero(stage=3, *, opt="none", param="none", **tiering):
    z = {"stage": stage, "offload_optimizer": {"device": opt}, "offload_param": {"device": param},
         "tiering": tiering}
    for block, dev in (("offload_optimizer", opt), ("offload_param", param)):
        if dev == "nvme":
            z[block]["nvme_path"] = "/tmp/zeroio-unused"
    if stage != 3:
        z.pop("offload_param")
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": z}


@pytest.mark.parametrize("zero, want", [
    (_zero(opt="nvme"), True), (_zero(opt="nvme", param="cpu"), True),
    (_zero(opt="cpu", param="cpu"), False), (_zero(), False),
    (_zero(opt="nvme", param="nvme"), True), (_zero(2, opt="nvme"), False),
    (_zero(opt="nvme", param="nvme", params_from_master=False), False),
    (_zero(opt="nvme", param="nvme", params_from_master=True), True),
    (_zero(opt="cpu", params_from_master=True), True),
    (_zero(opt="nvme", params_from_master=False), False),
])
def test_auto_and_explicit(zero, want):
    import zeroio
    from zeroio.config.policy import resolve_policies

    cfg = zeroio.load_config(zero, world_size=1)
    assert resolve_policies(cfg.zero_optimization).tiering.params_from_master is want


@pytest.mark.parametrize("zero, words", [
    (_zero(2, opt="cpu", params_from_master=True), "stage 3"),
    (_zero(1, params_from_master=True), "stage 3"),
    (_zero(opt="cpu", params_from_master=True, step_assist=True), "step_assist"),
    (_zero(params_from_master="yes"), '"auto"'),
])
def test_config_errors(zero, words):
    import zeroio

    with pytest.raises(zeroio.ConfigError) as e:
        zeroio.load_config(zero, world_size=1)
    assert "zero_optimization.tiering.params_from_master" in str(e.value)
    assert words in str(e.value)



W = "model.layers.0.mlp.up_proj.weight"


def _modifier_body(tmpdir):
    import zeroio
    from zeroio.testing.training import gathered_params, train_steps

    init = _init()
    batches = token_batches(1, steps=2, gas=1, micro=MICRO)
    out = {}
    for on in (False, True):
        e = _engine(_config("cpu", "cpu", "bf16", tmpdir, on=on), init)
        train_steps(e, batches[:1])
        before = gathered_params(e)[W]
        w = dict(e.module.named_parameters())[W]
        with zeroio.zero.GatheredParameters([w], modifier_rank=0):
            w.data.mul_(-1.0)
        after = gathered_params(e)[W]
        train_steps(e, batches[1:])
        out[on] = (before, after, _bytes(gathered_params(e)))
        e.close()
    return out


def test_modifier_write_back_reaches_the_master(tmp_path):
    """A ``GatheredParameters(modifier_rank=0)`` write lands in the masters the next gather
    casts (negated exactly), and training on from it equals the option off."""
    import torch

    (r,) = run_ranks(_modifier_body, 1, str(tmp_path), timeout=200)
    before, after, trained = r[True]
    assert before.abs().sum() > 0 and torch.equal(after, -before)
    assert trained == r[False][2]
