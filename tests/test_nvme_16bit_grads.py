"""16-bit host gradients with the optimizer on NVMe (optim/swap.py, [Note: the gradient a piece
reads]), against the plain-PyTorch reference and the estimate.

The tiny tied Llama (gradient checkpointing) with offload_optimizer nvme, bf16,
ZEROIO_CPU_ADAM=compiled, sub-groups of 3000 elements (several swapped pieces), on 1 and 2 gloo
ranks, at stages 1, 2 and 3 (stage 3 with offload_param cpu):

- gradient_accumulation_steps 1 (and 2 at stage 1, whose micro steps are summed on the GPU):
  the host gradient shard is bf16, ``SwappedAdam`` steps it with the one-pass kernel
  (``one_pass``), stage 1/2 fold the 1/world into its grad_scale (``grad_divisor``);
- gradient_accumulation_steps 2 at stages 2 and 3: fp32 (the host sums micro steps);
- each bf16 case runs a second time with the rule patched to fp32 host gradients (what NVMe
  offload did before): the host memory ``engine.stats()`` reports held outside stores differs
  by exactly 2 bytes per host gradient element, and at world 1 the two runs are bit-equal
  (every value of the reduced bucket is one bf16 gradient: the cast is exact, the kernel's
  upcast too).

Every run is held to the reference with the tolerances of tests/test_stage3_16bit_grads.py
(bf16: losses within 3e-2 relative, mean master drift within 15 %). A checkpoint saved after
3 of 6 steps and loaded into a new engine continues bit-equal to the run without the break.
The estimate's host gradient bytes for the model equal what the engine holds.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)
import torch

from zeroio.testing import run_ranks
from zeroio.testing.markers import needs_compiler
from zeroio.testing.models import llama_reference, offload_optimizer, token_batches
from zeroio.testing.training import (
    gather_state,
    gathered_params,
    reference_diffs,
    reference_failures,
    train_steps,
)

needs_nvme = pytest.mark.skipif(not eq._nvme_ready(), reason="no NVMe backend")

CASES = [(1, 1, "torch.bfloat16"), (1, 2, "torch.bfloat16"), (2, 1, "torch.bfloat16"),
         (2, 2, "torch.float32"), (3, 1, "torch.bfloat16"), (3, 2, "torch.float32")]
"""(stage, gradient_accumulation_steps, the host gradient shard's dtype)."""

STEPS = 4
RULE = {1: "zeroio.partition.stage12.host_grad_dtype", 2: "zeroio.partition.stage12.host_grad_dtype",
        3: "zeroio.partition.stage3.partitioner.host_grad_dtype"}


def _config(stage, gas, tmpdir):
    cfg = eq._config("cpu" if stage == 3 else "none", "nvme", "bf16", tmpdir, 0)
    cfg["gradient_accumulation_steps"] = gas
    zero = cfg["zero_optimization"]
    zero["stage"] = stage
    zero["offload_optimizer"] = offload_optimizer("nvme", tmpdir)
    if stage != 3:
        zero.pop("offload_param")
    return cfg


def _host_groups(engine):
    split = engine.partitioner.optimizer_split
    return split.host if split is not None else engine.partitioner.groups


def _estimated(engine, stage, cfg):
    """The estimate's host gradient and master bytes for this engine's model and config (the
    other host terms of the estimate are sizes of buffers, not of this model)."""
    import zeroio
    from zeroio.estimate import estimate_memory

    world = engine.world_size
    est = estimate_memory(engine.partitioner.index.total_numel, gpus_per_node=world,
                          config=zeroio.load_config(cfg, world_size=world))
    # every stage: the model states' 2-byte gradient partition and what the shard holds
    # beyond it (nothing, with 16-bit gradients) are the one host gradient shard
    grads = sum(i.bytes_per_gpu for i in est.items if i.tier == "cpu" and i.name in (
        "gradients", "gradient shard for the CPU optimizer",
        "fp32 gradient shard beyond the model states'"))
    masters = sum(i.bytes_per_gpu for i in est.items if i.name == "optimizer fp32 masters")
    return {"grads": grads, "masters": masters, "shard": -(-est.num_params // world)}


def _info(engine, stage, cfg):
    opt = engine.optimizer
    engine.synchronize()
    host = [g for g in _host_groups(engine) if g.grad.numel()]
    return {"one_pass": bool(opt.one_pass), "grad_divisor": opt.grad_divisor,
            "estimate": _estimated(engine, stage, cfg),
            "masters": sum(g.master.numel() * g.master.element_size() for g in host),
            "rule": str(engine.partitioner.host_grad_dtype),
            "host_grads": sorted({str(g.grad.dtype) for g in host}),
            "grad_bytes": sum(g.grad.numel() * g.grad.element_size() for g in host),
            "grad_numel": sum(g.grad.numel() for g in host),
            "held_cpu": engine.stats()["sources"]["held"]["tiers"]["cpu"]["used_bytes"]}


def _engine(stage, cfg, init, fp32_grads=False):
    import zeroio

    patch = mock.patch(RULE[stage], lambda **kw: torch.float32) if fp32_grads else \
        contextlib.nullcontext()
    with patch:
        model = eq.tiny_llama()
        model.load_state_dict(init)
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    return engine


def _train_body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    results = []
    for i, (stage, gas, dtype) in enumerate(CASES):
        batches = token_batches(world, steps=STEPS, gas=gas, micro=eq.MICRO)
        ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP)
        runs = {}
        for fp32_grads in (False, True) if dtype != "torch.float32" else (False,):
            cfg = _config(stage, gas, os.path.join(tmpdir, f"c{i}{fp32_grads}-r{rank}"))
            engine = _engine(stage, cfg, init, fp32_grads)
            losses = train_steps(engine, batches)
            params, masters = gathered_params(engine), gather_state(engine)
            info = _info(engine, stage, cfg)
            engine.close()
            runs[fp32_grads] = (losses, masters, info)
            results.append(dict(case=(stage, gas), world=world, fp32_grads=fp32_grads, **info,
                                **reference_diffs(losses, params, masters, ref_losses,
                                                  ref_params, init, "bf16")))
        if len(runs) == 2:
            (l16, m16, i16), (l32, m32, i32) = runs[False], runs[True]
            results[-1]["vs16"] = dict(
                same=l16 == l32 and all(torch.equal(m16[n], m32[n]) for n in m16),
                held_diff=i32["held_cpu"] - i16["held_cpu"], numel=i16["grad_numel"])
    return results


def _body(tmpdir):
    """Every check's runs in one process per rank (the kernel compiles once)."""
    return {"train": _train_body(os.path.join(tmpdir, "train")),
            "resume": {stage: _resume_body(os.path.join(tmpdir, f"resume{stage}"), stage)
                       for stage in (1, 2, 3)}}


_RESULTS: dict[int, list] = {}


@pytest.fixture(params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    """Per world size, each rank's results of ``_body`` (run once for all the tests)."""
    world = request.param
    if world not in _RESULTS:
        tmp = tmp_path_factory.mktemp(f"nvme16-w{world}")
        _RESULTS[world] = run_ranks(_body, world, str(tmp),
                                    env={"ZEROIO_CPU_ADAM": "compiled"}, timeout=900)
    return _RESULTS[world]


@needs_compiler
@needs_nvme
def test_nvme_16bit_host_grads_match_adamw(results):
    for rank_results in results:
        runs = rank_results["train"]
        assert len(runs) == sum(2 if c[2] != "torch.float32" else 1 for c in CASES)
        for r in runs:
            stage, gas = r["case"]
            want = next(c[2] for c in CASES if c[:2] == r["case"])
            if r["fp32_grads"]:
                want = "torch.float32"
            assert r["one_pass"], r  # the compiled kernel stepped the swapped pieces
            assert r["rule"] == want and r["host_grads"] == [want], r
            assert r["grad_bytes"] == r["grad_numel"] * (2 if want != "torch.float32" else 4)
            low = want != "torch.float32"
            # stages 1/2 hand the optimizer the unaveraged sum ([Note: 16-bit host gradients])
            assert r["grad_divisor"] == (float(r["world"]) if low and stage < 3 else 1.0), r
            assert not reference_failures(r, "bf16", fp32_tol=5e-5), r
            vs = r.get("vs16")
            if vs is None:
                continue
            # what engine.stats() reports held: 2 bytes less per host gradient element
            assert vs["held_diff"] == 2 * vs["numel"] > 0, r
            if r["world"] == 1:
                assert vs["same"], r


@needs_compiler
@needs_nvme
def test_estimate_host_gradients_equal_what_the_engine_holds(results):
    """The estimate's host gradient shard (2 bytes per element where the rule applies, 4 with
    accumulation at stages 2/3) and masters for the model: what the engine holds (up to stage
    3's padding of each group to a multiple of the world)."""
    for rank_results in results:
        for r in rank_results["train"]:
            if r["fp32_grads"]:
                continue  # the rule patched: the estimate does not know
            stage, gas = r["case"]
            per = 4 if gas > 1 and stage > 1 else 2
            est, shard = r["estimate"], r["estimate"]["shard"]
            assert (est["grads"], est["masters"]) == (per * shard, 4 * shard), r
            assert 0 <= r["grad_numel"] - shard <= 64, r
            assert r["grad_bytes"] == per * r["grad_numel"], r
            assert r["masters"] == 4 * r["grad_numel"], r


# ---- resume ---------------------------------------------------------------------------------

def _resume_body(tmpdir, stage):
    """6 steps straight; 3 steps, save, a new engine loads and trains 3 more: bit-equal."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    batches = token_batches(world, steps=6, gas=1, micro=eq.MICRO)
    ckpt = os.path.join(tmpdir, "ckpt")
    engine = _engine(stage, _config(stage, 1, os.path.join(tmpdir, f"a-r{rank}")), init)
    straight = train_steps(engine, batches)
    want = {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    engine.close()
    engine = _engine(stage, _config(stage, 1, os.path.join(tmpdir, f"b-r{rank}")), init)
    dtype = str(engine.partitioner.host_grad_dtype)
    losses = train_steps(engine, batches[:3])
    engine.save_checkpoint(ckpt, tag="t")
    engine.close()
    engine = _engine(stage, _config(stage, 1, os.path.join(tmpdir, f"c-r{rank}")), init)
    engine.load_checkpoint(ckpt, tag="t")
    losses += train_steps(engine, batches[3:])
    got = {k: gather_state(engine, k) for k in want}
    engine.close()
    return {"dtype": dtype, "losses": losses == straight,
            "diff": max((want[k][n] - got[k][n]).abs().max().item()
                        for k in want for n in want[k])}


@needs_compiler
@needs_nvme
def test_nvme_16bit_host_grads_resume_exact(results):
    for rank_results in results:
        for stage, r in rank_results["resume"].items():
            assert r == {"dtype": "torch.bfloat16", "losses": True, "diff": 0.0}, (stage, r)
