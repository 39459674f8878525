"""16-bit host gradients at stage 3 (partition/stage3/grads.py, [Note: 16-bit host gradients at
stage 3]), against the plain-PyTorch reference.

The tiny tied Llama (gradient checkpointing) at stage 3 with offload_param and
offload_optimizer cpu, bf16, ZEROIO_CPU_ADAM=compiled, on 1 and 2 gloo ranks:

- gradient_accumulation_steps 1, with and without tiering.overlap_step, and with
  offload_optimizer.ratio 0.5: the host gradient shard is bf16 (the device side's fp32);
- gradient_accumulation_steps 2: fp32 where the micro steps are summed on the host (a CPU
  device: no device room); on a GPU the placement puts the sum on the device
  (``Placement.accumulation_on_device``, config/accum_place.py), so nothing accumulates on
  the host and the host step reads bf16 as with one micro step;
- each bf16 case is run a second time with the rule patched to fp32 host gradients (what
  stage 3 did before). At world 1 the two runs must be bit-equal (losses, masters, the
  last gradient norm): every value of the fp32 bucket is one bf16 gradient, so the cast
  is exact and the kernel's upcast too. At world 2 the average is rounded to bf16: the
  runs must agree within bf16 tolerances, and the last gradient norm (taken on the
  fp32 average before the cast) must equal the norm of the host shards within bf16
  rounding.

Every run is held to the reference with the tolerances of tests/test_cpu_adam_training.py
(bf16: losses within 3e-2 relative, mean master drift within 15 %; published == masters
in bf16). Under ZEROIO_CPU_ADAM=torch the host gradients stay fp32; checkpoints saved with
bf16 host gradients load under the torch kernel (fp32 ones) and the other way round, the
state comes back bit for bit and training goes on within the reference's tolerances.
The estimate counts 2 bytes per host gradient element in that mode (hand computation).

Each run records the dtype the host step's CPU Adam reads (``grad_read_dtype``) and where the
gradient lives (``ShardGroup.grad``: a host shard, or on a GPU the device home it is streamed
from: [Note: the gradient's home] in zeroio/config/accum_place.py), and both are checked
against what the engine's placement decided.

On the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_stage3_16bit_grads.py
(there also: the gradient bytes that cross PCIe halve, and the gradient stays on the GPU).
"""

from __future__ import annotations

import contextlib
import math
import os
from unittest import mock

import pytest
import test_stage3_equivalence as eq  # noqa: I001 (tests/ is on sys.path under pytest)
import torch

from zeroio.testing import run_ranks
from zeroio.testing.cuda import exact_cuda_device, need_cuda
from zeroio.testing.markers import needs_compiler
from zeroio.testing.models import llama_reference, offload_optimizer, token_batches
from zeroio.testing.training import (
    gather_state,
    gathered_params,
    reference_diffs,
    reference_failures,
    shard_grad_norm,
    train_steps,
)

CASES = [(1, None, False, "torch.bfloat16"), (1, None, True, "torch.bfloat16"),
         (1, 0.5, False, "torch.bfloat16"), (2, None, False, "torch.float32")]
"""(gradient_accumulation_steps, offload_optimizer.ratio, tiering.overlap_step, the host
gradient shard's dtype)."""

STEPS = 4


def _config(gas, ratio, overlap, tmpdir):
    cfg = eq._config("cpu", "cpu", "bf16", tmpdir, 0)
    cfg["gradient_accumulation_steps"] = gas
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = offload_optimizer("cpu", ratio=ratio)
    zero["tiering"] = {"overlap_step": overlap}
    return cfg


def _info(engine):
    """What the run used, read just before the engine closes."""
    part, opt = engine.partitioner, engine.optimizer
    host_opt = getattr(opt, "host", opt)
    split = part.optimizer_split
    host = split.host if split is not None else part.groups
    dev = split.device if split is not None else []
    engine.synchronize()
    part.landing._norm_valid = False  # the norm from the shards as they stand (the fallback)
    return {"one_pass": bool(host_opt.one_pass),
            "grad_divisor": getattr(host_opt, "grad_divisor", 1.0),
            "rule": str(part.host_grad_dtype), "read": str(part.grad_read_dtype),
            "streamed": part.grads_streamed,
            "accum_dev": engine.placement.accumulation_on_device,
            "host_grads": sorted({str(g.grad.dtype) for g in host if g.grad.numel()}),
            "device_grads": sorted({str(g.grad.dtype) for g in dev if g.grad.numel()}),
            "host_numel": sum(g.grad.numel() for g in host),
            "shard_norm": shard_grad_norm(engine), "last_norm": engine.last_grad_norm,
            "d2h": engine.stats()["bytes_moved"].get("gpu->cpu", 0)}


def _train(batches, init, cfg, device, fp32_grads=False):
    """``train_llama`` with ``_info`` as inspect, and with the rule patched to fp32 host
    gradients (what stage 3 did before) when ``fp32_grads``."""
    import zeroio

    patch = mock.patch("zeroio.partition.stage3.partitioner.host_grad_dtype",
                       lambda **kw: torch.float32) if fp32_grads else contextlib.nullcontext()
    with patch:
        model = eq.tiny_llama()
        model.load_state_dict(init)
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    built = engine.stats()["bytes_moved"].get("gpu->cpu", 0)  # the shards and masters, once
    losses = train_steps(engine, batches, device=device)
    full = gathered_params(engine)
    masters = gather_state(engine, device=device)
    info = _info(engine)
    info["d2h"] -= built
    engine.close()
    return losses, full, masters, info


def _body(tmpdir, cuda):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = exact_cuda_device() if cuda else None
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    results = []
    for i, (gas, ratio, overlap, dtype) in enumerate(CASES):
        batches = token_batches(world, steps=STEPS, gas=gas, micro=eq.MICRO)
        ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP)
        runs = {}
        for fp32_grads in (False, True) if dtype != "torch.float32" else (False,):
            cfg = _config(gas, ratio, overlap, os.path.join(tmpdir, f"c{i}{fp32_grads}-r{rank}"))
            losses, params, masters, info = _train(batches, init, cfg, device, fp32_grads)
            runs[fp32_grads] = (losses, masters, info)
            results.append(dict(case=(gas, ratio, overlap), fp32_grads=fp32_grads, **info,
                                **reference_diffs(losses, params, masters, ref_losses,
                                                  ref_params, init, "bf16")))
        if len(runs) == 2:
            (l16, m16, i16), (l32, m32, i32) = runs[False], runs[True]
            results[-1]["vs16"] = dict(
                loss=max(abs(a - b) for a, b in zip(l16, l32, strict=True)),
                master=max((m16[n] - m32[n]).abs().max().item() for n in m16),
                norm=abs(i16["last_norm"] - i32["last_norm"]),
                d2h=(i16["d2h"], i32["d2h"]))
    return results


def _check(results, world, cuda):
    for rank_results in results:
        assert len(rank_results) == 2 * len(CASES) - 1
        for r in rank_results:
            gas, ratio, _ = r["case"]
            want = next(c[3] for c in CASES if c[:3] == r["case"])
            # the placement's decision: a sum on the device reads as one micro step's
            summed_on_device = gas > 1 and r["accum_dev"]
            if summed_on_device:
                want = "torch.bfloat16"
            if r["fp32_grads"]:
                want = "torch.float32"
            assert r["one_pass"], r  # the compiled kernel stepped the host masters
            assert r["rule"] == want and r["read"] == want, r
            # where the gradient lives: a host shard of that dtype, or the fp32 device sum
            assert r["host_grads"] == ["torch.float32" if summed_on_device else want], r
            # a CPU device has no room: the host path; a GPU keeps the gradient (the engine
            # runs the path the placement decided: the window onto the device gradient)
            assert r["streamed"] == cuda and r["accum_dev"] == (cuda and gas > 1), r
            assert r["device_grads"] == ([] if ratio is None else ["torch.float32"]), r
            assert r["grad_divisor"] == 1.0, r  # the 1/world is applied on the device
            # the last step's norm again, from the host shards as they stand (bf16 ones
            # rounded: within bf16's relative rounding, 2^-8)
            # (not with a CUDA device side: torch's fused CUDA Adam divides the gradient by
            # grad_scale in place, so after the step the ratio's device shard is unscaled;
            # seen on the H200)
            if not (cuda and ratio is not None):
                assert abs(r["shard_norm"] - r["last_norm"]) <= 4e-3 * r["last_norm"], r
            assert not reference_failures(r, "bf16", fp32_tol=5e-5), r
            vs = r.get("vs16")
            if vs is None:
                continue
            if world == 1:  # exact: [Note: 16-bit host gradients at stage 3]
                assert vs["loss"] == 0.0 and vs["master"] == 0.0 and vs["norm"] == 0.0, r
            else:
                assert vs["loss"] < 1e-2 and vs["master"] < 5e-3, r
            if cuda:  # the gradient bytes over PCIe halve (ratio 0.5: and its publish); each
                # step also reads its gradient norm, one fp32 scalar, from the device
                d16, d32 = (d - 4 * STEPS for d in vs["d2h"])
                assert d16 < d32 and (ratio is not None or 2 * d16 == d32), r


@needs_compiler
@pytest.mark.parametrize("world", [1, 2])
def test_16bit_host_grads_stage3_cpu(tmp_path, world):
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    _check(run_ranks(_body, world, str(tmp_path), False, env=env, timeout=900), world,
           cuda=False)


@pytest.mark.gpu
@needs_compiler
@pytest.mark.parametrize("world", [1, 2])
def test_16bit_host_grads_stage3_gpu(tmp_path, world):
    need_cuda(world)
    # the step assist off: its state copies would mix into the gradient bytes compared below
    env = {"ZEROIO_CPU_ADAM": "compiled", "ZEROIO_STEP_ASSIST": "0"}
    _check(run_ranks(_body, world, str(tmp_path), True, backend="nccl", env=env, timeout=600),
           world, cuda=True)


def test_torch_kernel_keeps_fp32_host_grads_stage3(tmp_path, monkeypatch):
    """ZEROIO_CPU_ADAM=torch: fp32 host gradients at stage 3, gas 1, bf16."""
    import zeroio

    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")
    engine, _, _, _ = zeroio.initialize(model=eq.tiny_llama(),
                                        config=_config(1, None, False, str(tmp_path)))
    try:
        assert engine.partitioner.host_grad_dtype == torch.float32
        assert {g.grad.dtype for g in engine.partitioner.groups} == {torch.float32}
        assert not engine.optimizer.one_pass and engine.optimizer.grad_divisor == 1.0
    finally:
        engine.close()


PLACEMENTS = [("nvme", "cpu", "torch.bfloat16"), ("none", "cpu", "torch.bfloat16"),
              ("cpu", "nvme", "torch.bfloat16")]
"""(offload_param, offload_optimizer, host gradient dtype) at gas 1: shards on NVMe (the
whole-group step, no output in the kernel's pass), shards on the GPU (DeviceShards: the
kernel steps, a copy publishes), and the optimizer on NVMe (its swapper steps each piece
with the kernel, reading the 16-bit gradient: optim/swap.py)."""


def _placement_body(tmpdir):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    batches = token_batches(world, steps=STEPS, gas=1, micro=eq.MICRO)
    ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP)
    results = []
    for i, (off_param, off_opt, _) in enumerate(PLACEMENTS):
        runs = []
        for fp32_grads in (False, True):
            cfg = eq._config(off_param, off_opt, "bf16",
                             os.path.join(tmpdir, f"p{i}{fp32_grads}-r{rank}"), 0)
            cfg["gradient_accumulation_steps"] = 1
            losses, params, masters, info = _train(batches, init, cfg, None, fp32_grads)
            runs.append((losses, masters))
            results.append(dict(case=(off_param, off_opt), fp32_grads=fp32_grads,
                                rule=info["rule"], host_grads=info["host_grads"],
                                **reference_diffs(losses, params, masters, ref_losses,
                                                  ref_params, init, "bf16")))
        (l16, m16), (l32, m32) = runs
        results[-1]["same"] = l16 == l32 and all(torch.equal(m16[n], m32[n]) for n in m16)
    return results


@needs_compiler
@pytest.mark.skipif(not eq._nvme_ready(), reason="no NVMe backend")
def test_16bit_host_grads_other_placements(tmp_path):
    env = {"ZEROIO_CPU_ADAM": "compiled"}
    results = run_ranks(_placement_body, 1, str(tmp_path), env=env, timeout=600)[0]
    assert len(results) == 2 * len(PLACEMENTS)
    for r in results:
        want = next(c[2] for c in PLACEMENTS if c[:2] == r["case"])
        if r["fp32_grads"]:
            want = "torch.float32"
        assert r["rule"] == want and r["host_grads"] == [want], r
        assert not reference_failures(r, "bf16", fp32_tol=5e-5), r
        if "same" in r:  # world 1: bit-equal to fp32 host gradients
            assert r["same"], r


# ---- checkpoints across the two host gradient dtypes ---------------------------------------

def _resume_body(tmpdir, first, second):
    """3 steps under ZEROIO_CPU_ADAM=``first``, save; a new engine under ``second`` loads it
    and trains 3 more; the state after the load and the whole run against the reference."""
    import torch.distributed as dist

    import zeroio

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in eq.tiny_llama().state_dict().items()}
    batches = token_batches(world, steps=6, gas=1, micro=eq.MICRO)
    ref_losses, ref_params = llama_reference(batches, init, lr=eq.LR, clip=eq.CLIP)
    ckpt = os.path.join(tmpdir, "ckpt")
    out = {}

    def engine_for(mode):
        os.environ["ZEROIO_CPU_ADAM"] = mode
        model = eq.tiny_llama()
        model.load_state_dict(init)
        cfg = _config(1, None, False, os.path.join(tmpdir, f"{mode}-r{rank}"))
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
        return engine

    engine = engine_for(first)
    out["dtypes"] = [str(engine.partitioner.host_grad_dtype)]
    losses = train_steps(engine, batches[:3])
    engine.save_checkpoint(ckpt, tag="t")
    saved = {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    engine.close()
    engine = engine_for(second)
    out["dtypes"].append(str(engine.partitioner.host_grad_dtype))
    engine.load_checkpoint(ckpt, tag="t")
    loaded = {k: gather_state(engine, k) for k in saved}
    out["load_diff"] = max((saved[k][n] - loaded[k][n]).abs().max().item()
                           for k in saved for n in saved[k])
    losses += train_steps(engine, batches[3:])
    params, masters = gathered_params(engine), gather_state(engine)
    engine.close()
    out.update(reference_diffs(losses, params, masters, ref_losses, ref_params, init, "bf16"))
    return out


@needs_compiler
@pytest.mark.parametrize("first,second", [("compiled", "torch"), ("torch", "compiled")])
def test_checkpoint_across_host_grad_dtypes(tmp_path, first, second):
    r = run_ranks(_resume_body, 1, str(tmp_path), first, second, timeout=600)[0]
    dtype = {"compiled": "torch.bfloat16", "torch": "torch.float32"}
    assert r["dtypes"] == [dtype[first], dtype[second]], r
    assert r["load_diff"] == 0.0, r
    assert not reference_failures(r, "bf16", fp32_tol=5e-5), r


# ---- the estimate ---------------------------------------------------------------------------

def _grad_items(est):
    """The estimate's gradient terms: the model states' ``gradients`` and the buffers'
    gradient shards."""
    return [i for i in est.items if i.name.startswith("gradients") or "gradient shard" in i.name]


@pytest.mark.parametrize("mode", ["compiled", "torch", "auto"])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_estimate_counts_16bit_host_grads(monkeypatch, mode, ratio):
    """Stage 3, offload cpu, bf16, gas 1: the host gradient shard is 2 bytes per host element
    under the one-pass kernel (``auto``: above its size threshold), 4 otherwise; the device
    side's (ratio) stays 4 bytes on the GPU."""
    from zeroio.estimate import estimate_memory
    from zeroio.optim import cpu_adam

    monkeypatch.setenv("ZEROIO_CPU_ADAM", mode)
    psi, n = 13_000_000_003, 1
    shard = math.ceil(psi / n)
    dev = math.floor(shard * (1.0 - ratio))
    host = shard - dev
    est = estimate_memory(psi, gpus_per_node=n, stage=3, offload_optimizer="cpu",
                          offload_param="cpu", dtype="bf16", ratio=ratio)
    # the model states keep the paper's 2-byte gradient term, the rest of an fp32 shard is a
    # zeroio buffer (estimate.py, module doc 2.): per tier they sum to what training holds
    grad_items = _grad_items(est)
    one_pass = mode == "compiled" or (mode == "auto" and host >= cpu_adam.AUTO_MIN_NUMEL)
    per_elem = 2 if one_pass else 4
    cpu = sum(i.bytes_per_gpu for i in grad_items if i.tier == "cpu")
    gpu = sum(i.bytes_per_gpu for i in grad_items if i.tier == "gpu")
    assert cpu == per_elem * host, grad_items
    assert gpu == 4 * dev, grad_items
    # the cpu total moves by exactly that much against an fp32 count
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")
    fp32 = estimate_memory(psi, gpus_per_node=n, stage=3, offload_optimizer="cpu",
                           offload_param="cpu", dtype="bf16", ratio=ratio)
    assert fp32.cpu_bytes_per_node - est.cpu_bytes_per_node == (4 - per_elem) * host


def test_estimate_fp32_host_grads_with_accumulation(monkeypatch):
    """gradient_accumulation_steps 2 (config): 4 bytes, with the optimizer on cpu or nvme; gas 1
    on nvme: 2 (its swapper steps with the one-pass kernel, optim/swap.py)."""
    import zeroio
    from zeroio.estimate import estimate_memory

    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    psi = 1_000_000
    cfg = cfg2 = zeroio.load_config(_config(2, None, False, "/tmp/unused"), world_size=1)
    est = estimate_memory(psi, config=cfg)
    assert est.stage == 3 and est.offload_optimizer == "cpu"
    assert sum(i.bytes_per_gpu for i in _grad_items(est)) == 4 * psi, est.items
    cfg = zeroio.load_config(_config(1, None, False, "/tmp/unused"), world_size=1)
    assert sum(i.bytes_per_gpu for i in _grad_items(estimate_memory(psi, config=cfg))) == 2 * psi
    nvme = estimate_memory(psi, stage=3, offload_optimizer="nvme", offload_param="cpu",
                           dtype="bf16")
    assert sum(i.bytes_per_gpu for i in _grad_items(nvme)) == 2 * psi
    nvme2 = estimate_memory(psi, stage=3, offload_optimizer="nvme", offload_param="cpu",
                            dtype="bf16", config=cfg2)
    assert nvme2.offload_optimizer == "nvme"
    assert sum(i.bytes_per_gpu for i in _grad_items(nvme2)) == 4 * psi
