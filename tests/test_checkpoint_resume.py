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
from zeroio.testing.training import rank_mean

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


def _config(world, stage, offload, nvme_dir, scheduler=True, dtype="fp32"):
    off = {"device": offload}
    if offload == "nvme":
        off["nvme_path"] = nvme_dir
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 37, "sub_group_size": 50,
                              "offload_optimizer": off},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8, "loss_scale_window": 2},
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
        x = x.to(next(engine.module.parameters()).dtype)
        out = engine(x[rank * per:(rank + 1) * per]).float()
        loss = torch.nn.functional.mse_loss(out, y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(rank_mean(loss.item()))
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
    """(stage, offload, dtype): stages 1-3 x offload in fp32; stage 0 (rank 0 alone writes);
    16-bit once each (16-bit params are republished from the fp32 masters; fp16 adds the
    dynamic loss scaler's state)."""
    offloads = ["none", "cpu"] + (["nvme"] if _nvme_available() else [])
    return ([(s, o, "fp32") for s in (1, 2, 3) for o in offloads]
            + [(0, "none", "fp32"), (2, "cpu", "bf16"), (1, "none", "fp16")])


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


PROBE = torch.arange(24).reshape(2, 12) % 96


def _hf_phase(root):
    """Stage 3 tiny Llama: 3 steps, then save_checkpoint, save_16bit_model and the model's logits."""
    import torch.distributed as dist

    import zeroio

    world = dist.get_world_size()
    cfg = _config(world, 3, "none", None, scheduler=False)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    torch.manual_seed(0)
    engine, *_ = zeroio.initialize(model=_llama(), config=cfg)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 96, (world, 2, 12), generator=g)[dist.get_rank()]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "hf-ck"), tag="t3")
    engine.save_16bit_model(os.path.join(root, "hf-16bit"))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE).logits.numpy().copy()
    engine.close()
    return logits


def _phase_a(root):
    """Same processes: exact-resume cases (10 straight; 5 + save), the universal-resume save,
    and the Hugging Face model."""
    return {"exact": _exact_phase_a(root), "universal": _universal_save(os.path.join(root, "uni")),
            "hf": _hf_phase(root)}


def _phase_b(root):
    """Fresh processes: exact-resume loads, and stage 2 -> stage 3 on the same 2 ranks."""
    return {"exact": _exact_phase_b(root), "stage3": _universal_resume(os.path.join(root, "uni"), 3)}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    a = run_ranks(_phase_a, 2, root, timeout=300)[0]
    b = run_ranks(_phase_b, 2, root, timeout=300)[0]
    return root, a, b


def _exact_phase_a(root):
    """10 steps straight, and 5 steps + save, for every case (same processes)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage, off, dt in _cases():
        cfg = _config(world, stage, off, os.path.join(root, f"nvme-{stage}-{off}-{dt}-a{rank}"), dtype=dt)
        e = _engine(cfg, 0.2, seed=0)
        torch.manual_seed(100 + rank)
        straight = _train(e, range(10))
        final = _full_masters(e)
        final["loss_scale"] = e.loss_scaler.scale  # fp16: grows from 2**8 every 2 clean steps
        e.close()
        e = _engine(cfg, 0.2, seed=0)
        torch.manual_seed(100 + rank)
        first = _train(e, range(5))
        e.save_checkpoint(os.path.join(root, f"ck-{stage}-{off}-{dt}"), client_state={"stage": stage, "off": off})
        if (stage, off, dt) == (3, "none", "fp32"):
            out["16bit_error"] = _save16_error(e, os.path.join(root, "no-16bit"))
        e.close()
        out[(stage, off, dt)] = (straight, first, final)
    return out


def _save16_error(engine, path):
    """stage 3 without stage3_gather_16bit_weights_on_model_save: the error text, nothing written."""
    from zeroio.errors import CheckpointError

    try:
        engine.save_16bit_model(path)
    except CheckpointError as err:
        return str(err), os.path.exists(path)
    return None, os.path.exists(path)


def _exact_phase_b(root):
    """Fresh processes: another init and RNG, load, 5 more steps."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage, off, dt in _cases():
        cfg = _config(world, stage, off, os.path.join(root, f"nvme-{stage}-{off}-{dt}-b{rank}"), dtype=dt)
        e = _engine(cfg, 0.2, seed=7)
        torch.manual_seed(999)
        path, client = e.load_checkpoint(os.path.join(root, f"ck-{stage}-{off}-{dt}"))
        assert client == {"stage": stage, "off": off}, client
        steps_after_load = e.global_steps
        rest = _train(e, range(5, 10))
        masters = _full_masters(e)
        masters["loss_scale"] = e.loss_scaler.scale
        out[(stage, off, dt)] = (rest, masters, steps_after_load, e.global_steps)
        e.close()
    return out


def test_resume_is_bit_exact_stages_1_2_3_with_and_without_offload_and_16bit(phases):
    _root, a, b = phases
    a, b = a["exact"], b["exact"]
    msg, written = a["16bit_error"]
    assert "stage3_gather_16bit_weights_on_model_save" in msg and "zeroio consolidate" in msg and not written
    for case in _cases():
        straight, first, final = a[case]
        rest, resumed, at_load, at_end = b[case]
        assert (at_load, at_end) == (5, 10), case
        assert first + rest == straight, (case, first + rest, straight)
        assert final.pop("loss_scale") == resumed.pop("loss_scale"), case
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


def test_resume_on_other_world_sizes_and_stage_follows_reference(phases):
    from zeroio.checkpoint import consolidate

    base, a, b = phases
    root = os.path.join(base, "uni")
    init, first, masters = a["universal"]
    ref, after5 = _reference_losses_const(init, range(10))
    assert first == pytest.approx(ref[:5], rel=1e-5)

    full = consolidate(root, "five")
    assert list(full) == list(masters)
    for n in masters:
        assert torch.equal(full[n], torch.from_numpy(masters[n])), n  # bit for bit: what the engine held
        torch.testing.assert_close(full[n], after5[n], rtol=1e-5, atol=1e-6)

    assert b["stage3"] == pytest.approx(ref[5:], rel=1e-5), ("2 ranks, stage 2 -> 3", b["stage3"], ref[5:])
    for world in (1, 3):
        got = run_ranks(_universal_resume, world, root, 2)[0]
        assert got == pytest.approx(ref[5:], rel=1e-5), (world, got, ref[5:])


def test_hf_llama_round_trips_through_consolidate_and_from_pretrained(phases, tmp_path):
    from transformers import AutoModelForCausalLM

    from zeroio.cli.main import main

    root, a, _b = phases
    out = tmp_path / "hf-out"
    assert main(["consolidate", os.path.join(root, "hf-ck"), str(out), "--quiet"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    for folder in (out, os.path.join(root, "hf-16bit")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE).logits
        assert torch.equal(logits, torch.from_numpy(a["hf"])), folder


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
