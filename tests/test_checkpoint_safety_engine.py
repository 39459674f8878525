"""A failed load leaves a live engine exactly as it was, on 2 gloo ranks at stage 2.

Train, save A, train more, save B (small chunks, so the two ranks read different chunk
files), corrupt one chunk of B's moments that only one rank reads: `load_checkpoint(B)`
fails on both ranks (one names the file, the other says another rank failed), every
rank's fp32 masters, moments, step counts, counters, LR schedule and RNG equal their
values before the call, and training on equals, bit for bit, a second engine that never
attempted the load. When applying fails after verification (forced here by skipping
the verification), the engine refuses to step until a load succeeds. A tag that is not one
folder name is refused before anything is written.
"""

from __future__ import annotations

from zeroio.testing import run_ranks

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _engine():
    import torch

    import zeroio

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 37}}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    return engine


def _train(engine, steps) -> list[float]:
    import torch
    import torch.distributed as dist

    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
        x, y = torch.randn(3, 6, generator=g), torch.randn(3, 3, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine) -> dict:
    import torch

    opt = engine.optimizer
    groups = engine.partitioner.groups
    return {
        "local": {(g.group_index, k): opt.local_tensor(g.group_index, k).clone() for g in groups for k in KINDS},
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps),
        "opt_steps": [opt.steps_taken(g.group_index) for g in groups],
        "sched": engine.lr_scheduler.state_dict(), "lr": engine.get_lr(), "rng": torch.get_rng_state(),
    }


def _same(a: dict, b: dict) -> list[str]:
    import torch

    bad = [f"local {k}" for k in a["local"] if not torch.equal(a["local"][k], b["local"][k])]
    bad += ["params"] * any(not torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    bad += [k for k in ("counters", "opt_steps", "sched", "lr") if a[k] != b[k]]
    return bad + ["rng"] * (not torch.equal(a["rng"], b["rng"]))


def _corrupt_a_chunk_rank1_alone_reads(engine, tdir, kind: str, chunk_elems: int) -> str | None:
    """Flip a byte of a chunk of ``kind`` that rank 1's shard touches and rank 0's does not."""
    import torch.distributed as dist

    mine = {c for g in engine.partitioner.groups for s in g.segments if s.numel
            for c in range(s.global_offset // chunk_elems, -(-(s.global_offset + s.numel) // chunk_elems))}
    every = [None, None]
    dist.all_gather_object(every, sorted(mine))
    if dist.get_rank() != 0:
        return None
    (chunk, *_) = sorted(set(every[1]) - set(every[0]))
    path = tdir / kind / "c" / str(chunk)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0x40
    path.write_bytes(bytes(raw))
    return str(path)


def _failed_loads(root: str) -> dict:
    from pathlib import Path

    import pytest
    import torch.distributed as dist

    import zeroio.checkpoint.reader as reader
    from zeroio.checkpoint import SaveOptions
    from zeroio.checkpoint.engine_io import save_checkpoint
    from zeroio.errors import CheckpointError

    root, out = Path(root), {}
    small = SaveOptions(chunk_bytes=64, progress=False)  # 16 elements a chunk: each rank reads its own
    eng, ref = _engine(), _engine()
    _train(eng, range(3))
    _train(ref, range(3))
    save_checkpoint(eng, root, "A", options=small)
    _train(eng, range(3, 5))
    _train(ref, range(3, 5))
    save_checkpoint(eng, root, "B", options=small)
    out["corrupt"] = _corrupt_a_chunk_rank1_alone_reads(eng, root / "B", "exp_avg_sq", 16)
    dist.barrier()
    before = _snapshot(eng)
    with pytest.raises(CheckpointError) as e:
        eng.load_checkpoint(root, tag="B")
    out["error"] = str(e.value)
    out["changed"] = _same(before, _snapshot(eng))
    out["losses"] = (_train(eng, range(5, 9)), _train(ref, range(5, 9)))  # on, as if never attempted
    out["after_training"] = _same(_snapshot(eng), _snapshot(ref))

    # applying fails after verification (skipped here): the engine refuses to train on the mix
    real = reader.ShardedLoad.verify
    reader.ShardedLoad.verify = lambda self: None
    try:
        with pytest.raises(CheckpointError, match="partly loaded") as e:
            eng.load_checkpoint(root, tag="B")
    finally:
        reader.ShardedLoad.verify = real
    out["apply_error"] = str(e.value)
    with pytest.raises(CheckpointError, match="partly loaded, so it cannot train: load a checkpoint again"):
        _train(eng, range(9, 10))
    eng.load_checkpoint(root, tag="A")  # a good load makes it usable again
    out["resumed_at"] = eng.global_steps
    _train(eng, range(3, 4))

    # a bad tag: refused before anything is written
    (root / "sub").mkdir(exist_ok=True)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"checkpoint tag '\.\.' is not allowed"):
        eng.save_checkpoint(root / "sub", tag="..")
    out["left"] = sorted(p.name for p in root.iterdir())
    return out


def test_failed_load_leaves_the_engine_as_it_was_and_training_on_matches(tmp_path):
    r0, r1 = run_ranks(_failed_loads, 2, str(tmp_path), timeout=300)
    corrupt = r0["corrupt"]
    errors = sorted([r0["error"], r1["error"]], key=lambda m: corrupt in m)
    assert "failed on another rank" in errors[0] and "engine is unchanged" in errors[0]
    assert f"{corrupt} (array 'exp_avg_sq'" in errors[1] and "is corrupt" in errors[1]
    for r in (r0, r1):
        assert r["changed"] == [], f"the failed load changed {r['changed']}"
        eng_losses, ref_losses = r["losses"]
        assert eng_losses == ref_losses and r["after_training"] == []
        assert "failed after it was verified" in r["apply_error"] and r["resumed_at"] == 3
        assert r["left"] == ["A", "B", "latest", "sub"]
