"""``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states``: bf16 masters,
gradient shards and Adam moments, stepped in fp32 and rounded back to bf16 every step.

The reference is plain PyTorch and knows nothing of zeroio: bf16 tensors held as they are,
upcast to fp32, stepped by ``torch.optim.AdamW`` (fused) with the gradient already divided
by the clip/loss-scale divisor, rounded back with ``Tensor.copy_`` (round to nearest-even).
Optimizer-level tests compare bit for bit. Engine-level tests allow the one difference that
is not a bug: the clip coefficient is the same norm summed in another order (per gradient
piece vs per parameter), so a few fp32 divisors differ in the last bit and an element's
bf16 rounding can flip; tolerances are stated where they are used.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import zeroio
from zeroio.optim import adam as adam_mod
from zeroio.optim.adam import ShardedAdam
from zeroio.optim.swap import SwappedAdam
from zeroio.partition.base import Segment, ShardGroup
from zeroio.testing import run_ranks

BF = torch.bfloat16
ON = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
"""Rank environment for the engine tests: their inputs and reference live on the CPU."""


# ---- config -------------------------------------------------------------------------------

def _cfg(bf16, zero=None):
    return {"train_batch_size": 2, "bf16": bf16,
            "zero_optimization": zero if zero is not None else {"stage": 2}}


def test_config_parses_and_round_trips():
    cfg = zeroio.load_config(_cfg(ON))
    assert (cfg.bf16.master_dtype, cfg.bf16.optimizer_state_dtype) == ("bf16", "bf16")
    assert "bf16.bf16_optimizer_states" not in cfg.unimplemented  # implemented, not ignored
    d = cfg.to_dict()
    assert d["bf16"] == ON
    assert zeroio.load_config(d).bf16 == cfg.bf16
    off = zeroio.load_config(_cfg({"enabled": True}))
    assert (off.bf16.master_dtype, off.bf16.optimizer_state_dtype) == ("fp32", "fp32")
    # DeepSpeed's mixed setting: bf16 masters, fp32 moments, with the optimizer offloaded
    mixed = zeroio.load_config(_cfg({"enabled": True, "bf16_master_weights_and_grads": True},
                                    {"stage": 3, "offload_optimizer": {"device": "cpu"}}))
    assert (mixed.bf16.master_dtype, mixed.bf16.optimizer_state_dtype) == ("bf16", "fp32")


@pytest.mark.parametrize("bf16,zero,key,words", [
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, None,
     "bf16.bf16_optimizer_states", "bf16.enabled"),
    ({"enabled": True, "bf16_optimizer_states": True}, None,
     "bf16.bf16_optimizer_states", "bf16_master_weights_and_grads"),
    ({"enabled": True, "bf16_master_weights_and_grads": True}, None,
     "bf16.bf16_master_weights_and_grads", "offload_optimizer.device"),
    (ON, {"stage": 0}, "bf16.bf16_optimizer_states", "stage 1, 2 or 3"),
    (ON, {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "bf16.bf16_optimizer_states", "ratio"),
    (dict(ON, bf16_optimizer_states="yes"), None, "bf16.bf16_optimizer_states", "true or false"),
])
def test_config_errors_name_the_key(bf16, zero, key, words):
    with pytest.raises(zeroio.ConfigError) as e:
        zeroio.load_config(_cfg(bf16, zero))
    assert e.value.key == key and words in str(e.value)


# ---- the reference ------------------------------------------------------------------------

class Reference:
    """bf16 master and moments; each step upcast, torch AdamW in fp32, rounded back."""

    def __init__(self, master: torch.Tensor, hyper: dict):
        self.master = master.clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.hyper, self.steps = hyper, 0

    def step(self, grad: torch.Tensor, divisor: float) -> None:
        p = torch.nn.Parameter(self.master.float())
        opt = torch.optim.AdamW([p], lr=self.hyper["lr"], betas=self.hyper["betas"],
                                eps=self.hyper["eps"], weight_decay=self.hyper["weight_decay"],
                                fused=True)
        opt.state[p] = {"step": torch.tensor(float(self.steps)),
                        "exp_avg": self.exp_avg.float(), "exp_avg_sq": self.exp_avg_sq.float()}
        p.grad = grad.float() / divisor
        opt.step()
        self.steps += 1
        self.master.copy_(p.detach())
        self.exp_avg.copy_(opt.state[p]["exp_avg"])
        self.exp_avg_sq.copy_(opt.state[p]["exp_avg_sq"])


def _group(n: int, seed: int) -> ShardGroup:
    g = torch.Generator().manual_seed(seed)
    return ShardGroup(group_index=0, master=torch.randn(n, generator=g).to(BF),
                      grad=torch.zeros(n, dtype=BF), numel=n,
                      segments=(Segment(local_offset=0, global_offset=0, numel=n),))


def _grads(n: int, steps: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, generator=g) * 3).to(BF) for _ in range(steps)]


@pytest.mark.parametrize("chunked", [False, True])
def test_sharded_adam_bf16_state_is_bitwise_the_reference(chunked, monkeypatch):
    monkeypatch.setattr(adam_mod, "UPCAST_PIECE", 61)  # many pieces, one ragged
    n = 1000
    group = _group(n, 1)
    ref = Reference(group.master, HYPER)
    opt = ShardedAdam([group], [dict(HYPER)], decoupled=True, state_dtype=BF)
    assert opt.group_states[0].exp_avg.dtype == BF and opt.group_states[0].exp_avg_sq.dtype == BF
    for i, grad in enumerate(_grads(n, 10)):
        divisor = 1.0 + 0.37 * i  # loss scale over a clip coefficient that bites
        group.grad.copy_(grad)
        if chunked:
            opt.step(grad_scale=divisor, on_updated=lambda *a: None, chunk_numel=300)
        else:
            opt.step(grad_scale=divisor)
        ref.step(grad, divisor)
    assert group.master.dtype == BF
    assert torch.equal(group.master, ref.master)
    assert torch.equal(opt.group_states[0].exp_avg, ref.exp_avg)
    assert torch.equal(opt.group_states[0].exp_avg_sq, ref.exp_avg_sq)
    assert opt.steps_taken(0) == 10
    moved = (ref.master.float() - _group(n, 1).master.float()).abs()
    assert (moved > 0).float().mean() > 0.5  # the weights did move in bf16


def test_swapped_adam_bf16_moments_on_disk(tmp_path):
    n = 700
    cfg = zeroio.load_config({
        "train_batch_size": 1, "bf16": ON,
        "zero_optimization": {"stage": 2, "sub_group_size": 256, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path)},
            "tiering": {"cpu_budget_bytes": 2 * 4096 * 2}}})
    group = _group(n, 2)
    ref = Reference(group.master, HYPER)
    opt = SwappedAdam([group], [dict(HYPER)], decoupled=True, cfg=cfg, piece_elems=100)
    assert opt.state_dtype == BF and opt.plan.itemsize == 2
    assert opt.plan.resident < len(opt.pieces)  # some pieces stream through the disk
    for i, grad in enumerate(_grads(n, 10)):
        group.grad.copy_(grad)
        opt.step(grad_scale=1.0 + 0.5 * i)
        ref.step(grad, 1.0 + 0.5 * i)
    assert opt.store.stats()["bytes_moved"].get("nvme->cpu", 0) > 0
    assert torch.equal(group.master, ref.master)
    for kind in ("exp_avg", "exp_avg_sq"):
        got = opt.local_tensor(0, kind)
        assert got.dtype == BF and torch.equal(got, getattr(ref, kind)), kind
    opt.store.flush()
    # the bytes on disk: every moment array is bf16, 2 bytes per element, and holds the
    # reference's bits (read back from the chunk files, not through zeroio)
    root = next((tmp_path / "zeroio-optim-rank0").glob("zeroio-swap-*"))
    names = {json.loads((d / "zarr.json").read_text())["attributes"]["tensor_name"]: d
             for d in root.iterdir() if (d / "zarr.json").exists()}
    assert len(names) == 2 * len(opt.pieces)
    for piece in opt.pieces:
        for kind in ("exp_avg", "exp_avg_sq"):
            d = names[piece.name(kind)]
            raw = b"".join(p.read_bytes() for p in sorted(d.rglob("*"))
                           if p.is_file() and p.name != "zarr.json")
            assert len(raw) >= 2 * piece.numel and len(raw) < 4 * piece.numel + 4096
            on_disk = torch.frombuffer(bytearray(raw[:2 * piece.numel]), dtype=BF)
            want = getattr(ref, kind)[piece.start:piece.start + piece.numel]
            assert torch.equal(on_disk, want), (piece, kind)
    opt.close()


# ---- the engine, stages 1/2/3 x offload none/cpu/nvme, two gloo ranks ----------------------

STEPS, LR, CLIP = 10, 1e-2, 0.05


def _model():
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g).to(BF), torch.randn(4, 3, generator=g)


def _loss(forward, x, y):
    return torch.nn.functional.mse_loss(forward(x).float(), y)


def _engine_reference(init, world, *, norm_of_bf16: bool):
    """Each rank's bf16 gradient summed over the ranks in fp32, halved, rounded to bf16 (what
    every stage's reduction gives at two ranks); global-norm clipping by the norm of that bf16
    gradient (``norm_of_bf16``: stages 1/2, which reduce in bf16) or of the fp32 average
    before the rounding (stage 3, which reduces in fp32); ``Reference`` steps."""
    model = _model().to(BF)
    model.load_state_dict(init)
    params = list(model.parameters())
    refs = [Reference(p.detach().reshape(-1), dict(HYPER, lr=LR, weight_decay=0.01))
            for p in params]
    for step in range(STEPS):
        grads = [torch.zeros(p.numel()) for p in params]
        for r in range(world):
            model.zero_grad()
            _loss(model, *_batch(step, r)).backward()
            for acc, p in zip(grads, params, strict=True):
                acc += p.grad.reshape(-1).float()
        avg = [g / world for g in grads]
        normed = [a.to(BF).float() if norm_of_bf16 else a for a in avg]
        norm = torch.stack([a.norm() for a in normed]).double().pow(2).sum().sqrt().item()
        coef = min(1.0, CLIP / (norm + 1e-6))
        for ref, a, p in zip(refs, avg, params, strict=True):
            ref.step(a.to(BF), 1.0 / coef)
            p.data.copy_(ref.master.view(p.shape))
    return refs


def _engine_body(tmpdir):
    import torch.distributed as dist

    from zeroio.testing.training import gather_state

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = {k: v.to(BF) for k, v in _model().state_dict().items()}
    refs = {stage: _engine_reference(init, world, norm_of_bf16=stage < 3) for stage in (1, 3)}
    names = [n for n, _ in _model().named_parameters()]
    out = []
    for stage in (1, 2, 3):
        for offload in ("none", "cpu", "nvme"):
            off = {"device": offload}
            if offload == "nvme":
                off["nvme_path"] = os.path.join(tmpdir, f"s{stage}-r{rank}")
            model = _model()
            model.load_state_dict(init)
            engine, *_ = zeroio.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "gradient_clipping": CLIP, "bf16": ON,
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                          "betas": [0.9, 0.99]}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 50,
                                      "sub_group_size": 60, "offload_optimizer": off,
                                      "stage3_param_persistence_threshold": 0}})
            clipped = 0
            for step in range(STEPS):
                engine.backward(_loss(engine, *_batch(step, rank)))
                engine.step()
                clipped += engine.last_grad_norm > CLIP
            dtypes = {str(engine.optimizer.local_tensor(g.group_index, k).dtype)
                      for g in engine.partitioner.groups for k in ("fp32", "exp_avg")}
            dtypes |= {str(g.grad.dtype) for g in engine.partitioner.groups}
            state = {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}
            diffs = {}
            for k, attr in (("fp32", "master"), ("exp_avg", "exp_avg"),
                            ("exp_avg_sq", "exp_avg_sq")):
                got = torch.cat([state[k][n].reshape(-1) for n in names])
                want = torch.cat([getattr(r, attr).float() for r in refs[3 if stage == 3 else 1]])
                ulp = want.abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 ulp, at most
                bad = (got - want).abs() > ulp
                diffs[k] = (float((got != want).float().mean()), int(bad.sum()))
            out.append(dict(case=(stage, offload), dtypes=sorted(dtypes), clipped=clipped,
                            diffs=diffs, sources=engine.stats()["sources"].get("precision")))
            engine.close()
    return out


def test_engine_matches_bf16_reference_every_stage_and_offload(tmp_path):
    # the reference is CPU arithmetic: the engines train on the CPU on a GPU machine too
    results = run_ranks(_engine_body, 2, str(tmp_path), timeout=400, env=CPU_ONLY)
    for rank_results in results:
        assert len(rank_results) == 9
        for r in rank_results:
            assert r["dtypes"] == ["torch.bfloat16"], r
            assert r["clipped"] >= STEPS // 2, r  # the clipping bites
            assert r["sources"]["optimizer_state_dtype"] == "bf16", r
            for k, (frac_differ, beyond_ulp) in r["diffs"].items():
                # bitwise for almost every element; the rest one bf16 ulp away (module doc)
                assert frac_differ <= 0.02 and beyond_ulp == 0, (r["case"], k, r["diffs"])


@pytest.mark.skipif(not (__import__("shutil").which("g++") or __import__("shutil").which("c++")),
                    reason="the one-pass CPU Adam needs a C++ compiler")
def test_one_pass_cpu_adam_bf16_state(monkeypatch):
    """The compiled kernel (ZEROIO_CPU_ADAM) on bf16 master, gradient and moments, writing the
    16-bit copy too: inductor's fp32 arithmetic may contract or reorder differently from torch's
    fused kernel, so rounding to bf16 may flip an element by one bf16 ulp (none seen here; at
    most 1% allowed), never more."""
    from zeroio.optim import cpu_adam

    n = 3000
    group = _group(n, 3)
    ref = Reference(group.master, HYPER)
    m, v = torch.zeros(n, dtype=BF), torch.zeros(n, dtype=BF)
    out = torch.empty(n, dtype=BF)
    for i, grad in enumerate(_grads(n, 10)):
        h = cpu_adam.hyper_tensor(lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], decoupled=True, step=i + 1,
                                  grad_scale=1.0 + 0.37 * i)
        cpu_adam.step_chunk(master=group.master, grad=grad, exp_avg=m, exp_avg_sq=v, hyper=h,
                            out=out)
        ref.step(grad, 1.0 + 0.37 * i)
    assert torch.equal(out, group.master)
    for got, want in ((group.master, ref.master), (m, ref.exp_avg), (v, ref.exp_avg_sq)):
        assert got.dtype == BF
        differ = got != want
        assert differ.float().mean() <= 0.01
        assert ((got.float() - want.float()).abs()[differ]
                <= want.float().abs()[differ] * 2.0 ** -7).all()


# ---- estimate and planner ------------------------------------------------------------------

def _estimate(bf16, offload):
    from zeroio.estimate import estimate_memory

    cfg = zeroio.load_config({"train_batch_size": 1, "bf16": bf16, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": offload, "nvme_path": "/x"}}})
    return {i.name: (i.tier, i.bytes_per_gpu) for i in estimate_memory(
        1_000_000, 1, 1, config=cfg).items}


def test_estimate_counts_two_byte_masters_and_moments():
    psi = 1_000_000
    on, off = _estimate(ON, "cpu"), _estimate({"enabled": True}, "cpu")
    assert off["optimizer states"] == ("cpu", 12 * psi)
    assert on["optimizer states"] == ("cpu", 6 * psi)  # bf16 master + two bf16 moments
    # the gradient shard is bf16: nothing beyond the model states' 2-byte gradient term
    assert "fp32 gradient shard beyond the model states'" in off
    assert not any("gradient shard beyond" in k for k in on)
    nv = _estimate(ON, "nvme")
    assert nv["optimizer moments"] == ("nvme", 4 * psi)
    assert nv["optimizer bf16 masters"] == ("cpu", 2 * psi)
    mixed = _estimate({"enabled": True, "bf16_master_weights_and_grads": True}, "cpu")
    assert mixed["optimizer states"] == ("cpu", 10 * psi)  # bf16 master, fp32 moments


def test_planner_plans_with_the_switches():
    from zeroio.plan import Machine, plan_placement

    machine = Machine(gpus=1, gpu_bytes=80 * 10**9, host_bytes=200 * 10**9,
                      disk_bytes=4 * 10**12, pcie_bps=25e9, disk_read_bps=6e9,
                      disk_write_bps=4e9, cpu_adam_elems_per_s=2e9)
    plain = plan_placement("20B", machine, micro_batch=1, seq=1024)
    low = plan_placement("20B", machine, micro_batch=1, seq=1024, bf16_optimizer_states=True)
    assert low.config["bf16"] == ON
    assert low.estimate.state_dtype == "bf16"
    state = {p.estimate.offload_optimizer: p for p in (plain, low)}
    assert state  # both planned; with bf16 state the optimizer needs half the bytes
    opt_bytes = [sum(i.bytes_per_gpu for i in p.estimate.items if "optimizer" in i.name)
                 for p in (plain, low)]
    assert opt_bytes[1] < opt_bytes[0]


# ---- checkpoints ---------------------------------------------------------------------------

def _ckpt_engine(bf16, nvme):
    torch.manual_seed(0)
    return zeroio.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 4, "bf16": bf16,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        if nvme is None else {"stage": 3, "sub_group_size": 60, "offload_optimizer": {
            "device": "nvme", "nvme_path": nvme}}})[0]


def _states(engine):
    from zeroio.testing.training import gather_state

    return {k: gather_state(engine, k) for k in ("fp32", "exp_avg", "exp_avg_sq")}


def _ckpt_body(tmpdir):
    out = {}
    for name, nvme in (("cpu", None), ("nvme", os.path.join(tmpdir, "swap"))):
        saved = _ckpt_engine(ON, nvme)
        for step in range(3):
            saved.backward(_loss(saved, *_batch(step, 0)))
            saved.step()
        want = _states(saved)
        saved.save_checkpoint(os.path.join(tmpdir, name), tag="t")
        saved.close()
        same = _ckpt_engine(ON, nvme)  # the same setting: the bits come back
        same.load_checkpoint(os.path.join(tmpdir, name), tag="t")
        got_same = _states(same)
        same.close()
        fp32 = _ckpt_engine({"enabled": True}, nvme)  # the other setting: upcast, exactly
        fp32.load_checkpoint(os.path.join(tmpdir, name), tag="t")
        kinds = {str(fp32.optimizer.local_tensor(0, k).dtype) for k in ("fp32", "exp_avg")}
        got_fp32 = _states(fp32)
        fp32.close()
        out[name] = dict(
            same=all(torch.equal(got_same[k][n], want[k][n]) for k in want for n in want[k]),
            fp32=all(torch.equal(got_fp32[k][n], want[k][n]) for k in want for n in want[k]),
            fp32_kinds=sorted(kinds),
            moved=any(bool(want["exp_avg"][n].abs().sum()) for n in want["exp_avg"]))
    return out


def test_checkpoint_keeps_bf16_state_and_converts_for_fp32(tmp_path):
    (r,) = run_ranks(_ckpt_body, 1, str(tmp_path), timeout=240, env=CPU_ONLY)
    for name, res in r.items():
        assert res["moved"] and res["same"] and res["fp32"], (name, res)
        assert res["fp32_kinds"] == ["torch.float32"], (name, res)
    for name in ("cpu", "nvme"):  # the arrays are stored as bf16: 2 bytes per element
        metas = {p.parent.name: json.loads(p.read_text())
                 for p in (tmp_path / name / "t").rglob("zarr.json")}
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert "bfloat16" in json.dumps(metas[kind]), (name, kind, metas.get(kind))
