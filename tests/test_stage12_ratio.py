"""``zero_optimization.offload_optimizer.ratio`` < 1 at stages 1 and 2 (offload_optimizer cpu).

The first floor((1 - r) * n) of each rank's n local optimizer elements keep master, gradient
shard and moments on the compute device (TwinAdam's device side); the rest is stepped by the
host step as at ratio 1 ([Note: stage 1/2 twin placement] in zeroio/partition/split.py).
Against plain torch AdamW + clip_grad_norm_ on ``tiny_mlp`` (435 elements: ratio 0.5 cuts the
16x16 weight, 0.8 the first 16x6 weight): world 1 and 2, stage 1 and 2, gradient
accumulation 2, the overlapped step on and off, fp32 (tight) and bf16 (loose vs torch, and
equal to the same run at ratio 1). An overlapped step whose host side is held back must let a
module with only device-side parameters run at once. Checkpoints saved at ratio 0.5 load at
ratio 1 and 0.25 and training continues as the uninterrupted reference. Loader errors.

On the GPU machine:  .venv/bin/python -m pytest -q -m gpu tests/test_stage12_ratio.py
"""

from __future__ import annotations

import math

import pytest
import torch

from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda
from zeroio.testing.models import mlp_batch, tiny_mlp

LR, CLIP, WD = 1e-2, 0.5, 0.1


def _config(stage, ratio, *, gas=1, overlap=False, dtype="fp32"):
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": gas,
           "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "offload_optimizer": {"device": "cpu", "ratio": ratio},
                                 "tiering": {"overlap_step": overlap}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _reference(world, steps, gas, first_step=0):
    """torch AdamW + clipping; micro step m of step s reads ``mlp_batch(s * gas + m, rank)``;
    the loss is the mean over ranks and micro steps. Per step the mean loss, and the final
    parameters (flat, in ``parameters()`` order)."""
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            outs = [torch.nn.functional.mse_loss(model(mlp_batch(step * gas + m, r)[0]),
                                                 mlp_batch(step * gas + m, r)[1])
                    for r in range(world)]
            (sum(outs) / (world * gas)).backward()
            total += sum(o.item() for o in outs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total / (world * gas))
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(engine, steps, gas, device, first_step=0):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = next(engine.module.parameters()).dtype
    totals = torch.zeros(steps, dtype=torch.float64)
    for i, step in enumerate(range(first_step, first_step + steps)):
        for m in range(gas):
            x, y = mlp_batch(step * gas + m, rank)
            loss = torch.nn.functional.mse_loss(engine(x.to(device, dtype)).float(),
                                                y.to(device))
            engine.backward(loss)
            engine.step()
            totals[i] += loss.item()
    engine.synchronize()  # no collective of ours while an overlapped step's gathers run
    totals = totals.to(engine.device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(totals)
    return (totals.cpu() / (world * gas)).tolist()


def _masters(engine):
    """Every rank's fp32 masters through the optimizer (``local_tensor``: TwinAdam joins both
    sides), summed over ranks into the global flat order."""
    import torch.distributed as dist

    engine.synchronize()
    part = engine.partitioner
    flat = torch.zeros(part.index.total_numel, dtype=torch.float64)
    for g in part.groups:
        local = engine.optimizer.local_tensor(g.group_index, "fp32").double().cpu()
        for s in g.segments:
            flat[s.global_offset:s.global_offset + s.numel] = \
                local[s.local_offset:s.local_offset + s.numel]
    flat = flat.to(engine.device)
    dist.all_reduce(flat)
    return flat.cpu().float()


def _run_cases(cases):
    """In a rank: one engine per case ``(stage, ratio, gas, overlap, dtype, steps)``."""
    import zeroio
    from zeroio.partition.stage3.twin import Side

    out = []
    for stage, ratio, gas, overlap, dtype, steps in cases:
        engine, *_ = zeroio.initialize(
            model=tiny_mlp(), config=_config(stage, ratio, gas=gas, overlap=overlap, dtype=dtype))
        part = engine.partitioner
        split = part.optimizer_split
        local_n = sum(g.padded_numel for g in part.groups)
        dev_n = split.numel(Side.DEVICE) if split is not None else 0
        dev_padded = sum(g.master.numel() for g in split.device) if split is not None else 0
        host_padded = sum(g.master.numel() for g in split.host) if split is not None else local_n
        losses = _train(engine, steps, gas, engine.device)
        masters = _masters(engine)
        params = torch.cat([p.detach().float().cpu().reshape(-1)
                            for p in engine.module.parameters()])
        engine.close()
        out.append(dict(local_n=local_n, dev_n=dev_n, dev_padded=dev_padded,
                        host_padded=host_padded, losses=losses, masters=masters.tolist(),
                        params=params.tolist(),
                        twin=type(engine.optimizer).__name__ == "TwinAdam"))
    return out


STEPS = 3
FP32_CASES = [  # (stage, ratio, gas, overlap, dtype, steps)
    (2, 0.5, 1, False, "fp32", STEPS), (2, 0.5, 1, True, "fp32", STEPS),
    (2, 0.8, 2, True, "fp32", STEPS), (2, 0.5, 2, False, "fp32", STEPS),
    (1, 0.5, 1, True, "fp32", STEPS), (1, 0.8, 2, False, "fp32", STEPS),
]
BF16_CASES = [(2, 0.5, 2, True, "bf16", STEPS), (2, 1.0, 2, True, "bf16", STEPS)]


def _check_split(r, ratio):
    assert r["twin"]
    assert r["dev_padded"] == math.floor((1 - ratio) * r["local_n"])
    assert r["dev_n"] > 0 and r["dev_padded"] + r["host_padded"] == r["local_n"]


@pytest.mark.parametrize("world", [1, 2])
def test_ratio_training_matches_torch(world):
    results = run_ranks(_run_cases, world, FP32_CASES + BF16_CASES, timeout=300)
    refs = {gas: _reference(world, STEPS, gas) for gas in (1, 2)}
    for rank_results in results:
        for case, r in zip(FP32_CASES, rank_results, strict=False):
            stage, ratio, gas, _, _, _ = case
            _check_split(r, ratio)
            ref_losses, ref_params = refs[gas]
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), case
            torch.testing.assert_close(torch.tensor(r["masters"]), ref_params, rtol=1e-5,
                                       atol=1e-6, msg=str(case))
            torch.testing.assert_close(torch.tensor(r["params"]), ref_params, rtol=1e-5,
                                       atol=1e-6, msg=str(case))
        bf_split, bf_whole = rank_results[len(FP32_CASES):]
        _check_split(bf_split, 0.5)
        # the device side steps the same elements with the same kernel: equal to ratio 1
        assert bf_split["losses"] == pytest.approx(bf_whole["losses"], rel=1e-6)
        torch.testing.assert_close(torch.tensor(bf_split["masters"]),
                                   torch.tensor(bf_whole["masters"]), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.tensor(bf_split["params"]),
                                   torch.tensor(bf_split["masters"]).bfloat16().float())
        ref_losses, ref_params = refs[2]
        assert bf_split["losses"] == pytest.approx(ref_losses, rel=3e-2)
        assert (torch.tensor(bf_split["masters"]) - ref_params).abs().max() < 2e-2


# ---- the overlapped step: device-only modules wait for nothing ----------------------------

def _overlap_body():
    import threading

    import zeroio
    from zeroio.optim.adam import ShardedAdam

    engine, *_ = zeroio.initialize(model=tiny_mlp(),
                                   config=_config(2, 0.5, overlap=True))
    part = engine.partitioner
    released = threading.Event()
    log = {"released_by_main": 0, "chunks": 0}
    begin = ShardedAdam.begin_chunked_step

    def slow_begin(self, grad_scale=1.0):  # the host side's chunks only (TwinAdam.host)
        chunked = begin(self, grad_scale)
        update = chunked.update

        def held_update(gi, lo, k, **kw):
            if log["chunks"] == 0 and released.wait(timeout=20):
                log["released_by_main"] += 1
            log["chunks"] += 1
            update(gi, lo, k, **kw)

        chunked.update = held_update
        return chunked

    ShardedAdam.begin_chunked_step = slow_begin
    first = engine.module[0]  # 6x16 weight + bias: 112 of 435 elements, all device-side
    outs = []
    for step in range(2):
        x, y = mlp_batch(step, 0)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        released.clear()
        log["chunks"] = 0
        engine.step()
        with torch.no_grad():  # runs while the host side is held back
            outs.append(first(mlp_batch(50, 0)[0]).tolist())
        released.set()
    engine.synchronize()
    engine.close()
    return outs, log["released_by_main"], len(part._chunks)


def test_overlapped_step_device_side_module_does_not_wait():
    (outs, released_by_main, n_chunks), = run_ranks(_overlap_body, 1)
    assert n_chunks > 0
    assert released_by_main == 2, "the all-device module waited for the held host chunk"
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = mlp_batch(step, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            want = model[0](mlp_batch(50, 0)[0])
        torch.testing.assert_close(torch.tensor(outs[step]), want, rtol=1e-5, atol=1e-6)


# ---- checkpoints across ratios -------------------------------------------------------------

def _ckpt_body(tmpdir):
    import zeroio

    gas, out = 2, {}
    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(2, 0.5, gas=gas))
    out["first"] = _train(engine, 2, gas, engine.device)
    engine.save_checkpoint(tmpdir, tag="t")
    engine.close()
    for ratio in (1.0, 0.25, 0.5):
        engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(
            2, ratio, gas=gas, overlap=ratio == 0.25))
        engine.load_checkpoint(tmpdir, tag="t")
        loaded = _masters(engine)
        out[ratio] = dict(loaded=loaded.tolist(),
                          losses=_train(engine, 2, gas, engine.device, first_step=2),
                          masters=_masters(engine).tolist(), steps=engine.global_steps)
        engine.close()
    return out


@pytest.mark.parametrize("world", [2])
def test_checkpoint_at_one_ratio_loads_at_another(tmp_path, world):
    results = run_ranks(_ckpt_body, world, str(tmp_path), timeout=300)
    ref_losses, ref_params = _reference(world, 4, 2)
    _, mid_params = _reference(world, 2, 2)
    for out in results:
        assert out["first"] == pytest.approx(ref_losses[:2], rel=1e-5, abs=1e-6)
        for ratio in (1.0, 0.25, 0.5):
            r = out[ratio]
            torch.testing.assert_close(torch.tensor(r["loaded"]), mid_params, rtol=1e-5,
                                       atol=1e-6)
            assert r["steps"] == 4
            # continuing needs the moments and step counts back, not only the masters
            assert r["losses"] == pytest.approx(ref_losses[2:], rel=1e-5, abs=1e-6), ratio
            torch.testing.assert_close(torch.tensor(r["masters"]), ref_params, rtol=1e-5,
                                       atol=1e-6, msg=str(ratio))


# ---- loader ----------------------------------------------------------------------------------

@pytest.mark.parametrize("zero,needle", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "needs zero_optimization.stage 1, 2 or 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "ratio": 0.5}},
     'offload_optimizer.device "cpu"'),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}, "> 0.0 and <= 1.0"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "> 0.0 and <= 1.0"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "half"}}, "ratio"),
])
def test_loader_rejects(zero, needle):
    from zeroio.config import load_config
    from zeroio.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert e.value.key == "zero_optimization.offload_optimizer.ratio"
    assert needle in str(e.value)


@pytest.mark.parametrize("stage", [1, 2])
def test_loader_accepts_cpu_ratio(stage):
    from zeroio.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.3


# ---- GPU -------------------------------------------------------------------------------------

def _gpu_body():
    import zeroio
    from zeroio.partition.stage3.twin import Side

    out = {}
    for ratio in (0.5, 1.0):
        engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(
            2, ratio, gas=2, overlap=True, dtype="bf16"))
        split = engine.partitioner.optimizer_split
        if split is not None:
            out["dev_on_cuda"] = all(g.master.device.type == "cuda" for g in split.device)
            out["dev_n"] = split.numel(Side.DEVICE)
        losses = _train(engine, STEPS, 2, engine.device)
        out[ratio] = dict(losses=losses, masters=_masters(engine).tolist(),
                          params=torch.cat([p.detach().float().cpu().reshape(-1)
                                            for p in engine.module.parameters()]).tolist())
        engine.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_stage2_ratio_bf16_overlap(world):
    need_cuda(world)
    outs = run_ranks(_gpu_body, world, timeout=300, backend="nccl" if world > 1 else "gloo")
    ref_losses, ref_params = _reference(world, STEPS, 2)
    for out in outs:
        _check_gpu_rank(out, ref_losses, ref_params)


def _check_gpu_rank(out, ref_losses, ref_params):
    assert out["dev_on_cuda"] and out["dev_n"] > 0
    got = out[0.5]
    assert got["losses"] == pytest.approx(ref_losses, rel=3e-2)
    assert (torch.tensor(got["masters"]) - ref_params).abs().max() < 2e-2
    # the fused CUDA Adam vs the CPU one on the device side: rounding differences, which a
    # bf16 forward can grow to about one bf16 step of a parameter (lr 1e-2 moves them 1e-2)
    assert (torch.tensor(got["masters"]) - torch.tensor(out[1.0]["masters"])).abs().max() < 5e-3
    torch.testing.assert_close(torch.tensor(got["params"]),
                               torch.tensor(got["masters"]).bfloat16().float())


# ---- memory estimate -------------------------------------------------------------------------

def test_estimate_stage12_ratio_by_hand():
    import zeroio

    # stage 2, fp32, 4000 parameters on one GPU, ratio 0.25: floor(0.75 * 4000) = 3000 elements
    # keep master + two moments (12 B) and their fp32 gradient (4 B) on the GPU
    psi, rbs, agbs = 4000, 1000, 3000
    cfg = zeroio.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": rbs, "allgather_bucket_size": agbs,
        "overlap_comm": False, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}})
    est = zeroio.estimate_memory(psi, config=cfg, dtype="fp32")
    assert est.device_elements == 3000
    buffers = 4 * rbs + 4 * agbs  # one fp32 reduce bucket, the all-gather bucket
    assist = 4 * 1000 * 16  # step assist: 4 slots as large as the 1000 host elements, fp32
    assert est.gpu_bytes_per_gpu == 4 * psi + 16 * 3000 + buffers + assist
    assert est.cpu_bytes_per_node == 16 * 1000
    plain = zeroio.estimate_memory(psi, stage=2, offload_optimizer="cpu", dtype="fp32",
                                   zeroio_buffers=False)
    assert plain.gpu_bytes_per_gpu == 4 * psi and plain.cpu_bytes_per_node == 16 * psi
    # stage 1, bf16, two GPUs: the shard is 2000, 1000 on the GPU at ratio 0.5; the 16-bit
    # gradients are replicated (2 Psi), the paper's 2-byte gradient shard for the CPU optimizer
    # and the fp32 gradient shard (4 B) split with the optimizer state (12 B)
    est = zeroio.estimate_memory(psi, gpus_per_node=2, stage=1, offload_optimizer="cpu",
                                 dtype="bf16", ratio=0.5, zeroio_buffers=False)
    assert est.gpu_bytes_per_gpu == 2 * psi + 2 * psi + (2 + 12) * 1000
    assert est.cpu_bytes_per_node == 2 * (2 + 12) * 1000


# ---- two optimizer groups: the cut in the second one -----------------------------------------

def _groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": WD},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _groups_body(ratio):
    import zeroio
    from zeroio.partition.stage3.twin import Side

    model = tiny_mlp()
    engine, *_ = zeroio.initialize(model=model, model_parameters=_groups(model),
                                   config=_config(2, ratio, gas=2, overlap=True))
    part = engine.partitioner
    split = part.optimizer_split
    dev = [g.master.numel() for g in split.device]
    host = [g.master.numel() for g in split.host]
    losses = _train(engine, STEPS, 2, engine.device)
    masters = _masters(engine)
    engine.close()
    return dict(dev=dev, host=host, local_n=sum(g.padded_numel for g in part.groups),
                dev_n=split.numel(Side.DEVICE), losses=losses, masters=masters.tolist())


def test_two_optimizer_groups_cut_in_the_second():
    ratio, world = 0.05, 2
    results = run_ranks(_groups_body, world, ratio)
    model = tiny_mlp()
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    ref_losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(2):
            outs = [torch.nn.functional.mse_loss(model(mlp_batch(step * 2 + m, r)[0]),
                                                 mlp_batch(step * 2 + m, r)[1])
                    for r in range(world)]
            (sum(outs) / (world * 2)).backward()
            total += sum(o.item() for o in outs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        ref_losses.append(total / (world * 2))
    # the engine's flat order is module order; compare parameter by parameter
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for r in results:
        assert r["host"][0] == 0 and r["dev"][1] > 0 and r["host"][1] > 0  # cut in group 1
        assert sum(r["dev"]) == math.floor((1 - ratio) * r["local_n"]) and r["dev_n"] > 0
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(torch.tensor(r["masters"]), ref, rtol=1e-5, atol=1e-6)
