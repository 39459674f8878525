"""Resume through a checkpoint with a live engine, on gloo ranks.

- exact: 10 steps straight == 5 steps, save, load in fresh processes, 5 more,
  bit for bit in fp32 (losses and parameters), stages 1, 2, 3 x offload
  none / cpu (/ nvme when the swap optimizer is present). The model has
  dropout and the config a warmup schedule and clipping, so RNG, scheduler,
  step counts and moments must all come back exactly.
- universal: saved by 2 ranks at stage 2, resumed on 1 and 3 ranks at stage 2
  and on 2 ranks at stage 3; losses follow an uninterrupted single-process
  PyTorch AdamW run. fp32 everywhere; the engine sums gradients over ranks in
  another order than one batched backward, a few ulps a step, so losses are
  compared at 1e-5 relative (Adam normalises updates; over 10 steps the
  differences stay ~1e-6).
- consolidate(checkpoint) equals the fp32 weights gathered from the engine
  (bit for bit) and the reference model's (1e-5).
"""

from __future__ import annotations

import os

import pytest
import torch

from zeroio.testing import run_ranks

LR, CLIP, GLOBAL_BATCH = 1e-2, 0.5, 6


def _mlp(dropout: float):
    return torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _nvme_available() -> bool:
    try:
        import zeroio.optim.swap  # noqa: F401
        return True
    except ImportError:
        return False


def _config(world, stage, offload, nvme_dir, scheduler=True):
    off = {"device": offload}
    if offload == "nvme":
        off["nvme_path"] = nvme_dir
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 37, "sub_group_size": 50,
                              "offload_optimizer": off},
        "bf16": {"enabled": False},
    }
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 4}}
    return cfg


def _engine(cfg, dropout, seed):
    import zeroio

    torch.manual_seed(seed)
    engine, *_ = zeroio.initialize(model=_mlp(dropout), config=cfg)
    return engine


def _train(engine, steps):
    """Each rank takes its slice of the global batch; returns global mean losses."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    losses = []
    for i in steps:
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _full_masters(engine):
    """Every rank's fp32 masters put back in global order (test-side all-reduce, not zeroio's gather)."""
    import torch.distributed as dist

    flat = torch.zeros(engine.partitioner.index.total_numel, dtype=torch.float64)
    for g in engine.partitioner.groups:
        m = engine.optimizer.local_tensor(g.group_index, "fp32")
        for s in g.segments:
            flat[s.global_offset:s.global_offset + s.numel] = m[s.local_offset:s.local_offset + s.numel].double()
    if engine.partitioner.stage != 0:
        dist.all_reduce(flat)
    # numpy, not tensors: tensors cross run_ranks' queue as shared-memory handles of a dead process
    return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape).float().numpy()
            for e in engine.partitioner.index.entries}


def _cases():
    offloads = ["none", "cpu"] + (["nvme"] if _nvme_available() else [])
    return [(s, o) for s in (1, 2, 3) for o in offloads]


def _exact_phase_a(root):
    """10 steps straight, and 5 steps + save, for every case (same processes)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage, off in _cases():
        cfg = _config(world, stage, off, os.path.join(root, f"nvme-{stage}-{off}-a{rank}"))
        e = _engine(cfg, 0.2, seed=0)
        torch.manual_seed(100 + rank)
        straight = _train(e, range(10))
        final = _full_masters(e)
        e.close()
        e = _engine(cfg, 0.2, seed=0)
        torch.manual_seed(100 + rank)
        first = _train(e, range(5))
        e.save_checkpoint(os.path.join(root, f"ck-{stage}-{off}"), client_state={"stage": stage, "off": off})
        e.close()
        out[(stage, off)] = (straight, first, final)
    return out


def _exact_phase_b(root):
    """Fresh processes: another init and RNG, load, 5 more steps."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage, off in _cases():
        cfg = _config(world, stage, off, os.path.join(root, f"nvme-{stage}-{off}-b{rank}"))
        e = _engine(cfg, 0.2, seed=7)
        torch.manual_seed(999)
        path, client = e.load_checkpoint(os.path.join(root, f"ck-{stage}-{off}"))
        assert client == {"stage": stage, "off": off}, client
        steps_after_load = e.global_steps
        rest = _train(e, range(5, 10))
        out[(stage, off)] = (rest, _full_masters(e), steps_after_load, e.global_steps)
        e.close()
    return out


def test_resume_is_bit_exact_stages_1_2_3_with_and_without_offload(tmp_path):
    a = run_ranks(_exact_phase_a, 2, str(tmp_path), timeout=240)[0]
    b = run_ranks(_exact_phase_b, 2, str(tmp_path), timeout=240)[0]
    for case in _cases():
        straight, first, final = a[case]
        rest, resumed, at_load, at_end = b[case]
        assert (at_load, at_end) == (5, 10), case
        assert first + rest == straight, (case, first + rest, straight)
        for name, t in final.items():
            assert (resumed[name] == t).all(), (case, name)


# ---------------------------------------------------------------- universal resume


def _universal_save(root):
    import torch.distributed as dist

    e = _engine(_config(dist.get_world_size(), 2, "none", None, scheduler=False), 0.0, seed=0)
    init = {k: v.numpy().copy() for k, v in e.module.state_dict().items()}
    losses = _train(e, range(5))
    e.save_checkpoint(root, tag="five")
    masters = _full_masters(e)
    e.close()
    return init, losses, masters


def _universal_resume(root, stage):
    import torch.distributed as dist

    e = _engine(_config(dist.get_world_size(), stage, "cpu", None, scheduler=False), 0.0, seed=3)
    e.load_checkpoint(root, tag="five")
    losses = _train(e, range(5, 10))
    e.close()
    return losses


def test_resume_on_other_world_sizes_and_stage_follows_reference(tmp_path):
    from zeroio.checkpoint import consolidate

    root = str(tmp_path / "ck")
    init, first, masters = run_ranks(_universal_save, 2, root)[0]
    ref, after5 = _reference_losses_const(init, range(10))
    assert first == pytest.approx(ref[:5], rel=1e-5)

    full = consolidate(root, "five")
    assert list(full) == list(masters)
    for n in masters:
        assert torch.equal(full[n], torch.from_numpy(masters[n])), n  # bit for bit: what the engine held
        torch.testing.assert_close(full[n], after5[n], rtol=1e-5, atol=1e-6)

    for world, stage in ((1, 2), (3, 2), (2, 3)):
        got = run_ranks(_universal_resume, world, root, stage)[0]
        assert got == pytest.approx(ref[5:], rel=1e-5), (world, stage, got, ref[5:])


def _reference_losses_const(init_state, steps):
    model = _mlp(0.0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, after5 = [], None
    for i in steps:
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i == 4:
            after5 = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, after5
