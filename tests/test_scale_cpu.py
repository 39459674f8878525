"""Scale-out, CPU part: zeroio at 4 and 8 gloo ranks trains like single-process AdamW.

A tiny residual-MLP language model (fp32) trains STEPS steps with
- stage 2, optimizer offloaded to the CPU, and
- stage 3, parameters offloaded to the CPU and the optimizer to NVMe (a tmp dir),
on world sizes 4 and 8 (one ``run_ranks`` per world size; the rank body runs
both configurations). Each rank draws its own micro batch from one global
batch; the reference trains one process on the whole global batch with
``torch.optim.AdamW`` and the same clipping.

Tolerance: fp32 in both, only the summation order differs (gradients are
reduce-scattered over 4 or 8 ranks instead of summed in one backward), a few
ulps per step that Adam's normalised update keeps at ~1e-6 after STEPS
steps; we allow 2e-5 relative on each step's loss and 5e-5 absolute on
every parameter at the end. A wrong shard offset, a missing reduction or a
gradient averaged over the wrong count moves the loss by far more (checked:
the losses change by > 1e-3 between steps at this learning rate).
"""

from __future__ import annotations

import os

import pytest

from zeroio.testing import run_ranks

STEPS, MICRO, SEQ, LR, CLIP, VOCAB = 4, 1, 8, 3e-3, 0.5, 96


def _model():
    """A tiny residual MLP language model (plain torch: 8 ranks must not each import
    transformers on a 2-core machine); ``forward(input_ids, labels)`` returns ``.loss``
    like a Hugging Face causal LM, with next-token labels."""
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 24)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24))
                for _ in range(2))
            self.norm = nn.LayerNorm(24)
            self.head = nn.Linear(24, VOCAB, bias=False)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = x + block(x)
            logits = self.head(self.norm(x))[:, :-1]
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                               labels[:, 1:].reshape(-1))
            return type("Out", (), {"loss": loss})()

    model = TinyLM()
    model.train()
    return model


def _batches(world):
    import torch

    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (world, MICRO, SEQ), generator=g) for _ in range(STEPS)]


def _init_state():
    import torch

    torch.manual_seed(7)
    return {k: v.clone() for k, v in _model().state_dict().items()}


def _reference(world):
    from zeroio.testing.reference import adamw_reference

    model = _model()
    model.load_state_dict(_init_state())

    def loss_of(m, ids):
        batch = ids.reshape(-1, SEQ)
        return m(input_ids=batch, labels=batch).loss

    return adamw_reference(model, ([ids] for ids in _batches(world)), loss_of,
                           lr=LR, weight_decay=0.01, clip=CLIP)


def _config(stage, nvme_dir):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero = {"stage": 3, "sub_group_size": 2000,
                "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": zero, "bf16": {"enabled": False}}


def _rank_body(nvme_root):
    """Both configurations on this rank; returns {stage: (mean losses, full params)}."""
    import torch
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(world)
    out = {}
    for stage in (2, 3):
        cfg = _config(stage, os.path.join(nvme_root, f"stage{stage}"))
        torch.manual_seed(0)  # zero.Init may draw; the weights come from load_state_dict
        if stage == 3:
            with zeroio.zero.Init(config=cfg):
                model = _model()
        else:
            model = _model()
        init = _init_state()
        if stage == 3:
            params = dict(model.named_parameters())
            with zeroio.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                if rank == 0:
                    for n, p in params.items():
                        p.data.copy_(init[n])
        else:
            model.load_state_dict(init)
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
        losses = []
        for ids in batches:
            loss = engine(input_ids=ids[rank], labels=ids[rank]).loss
            engine.backward(loss)
            engine.step()
            total = torch.tensor([loss.item()], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(total.item() / world)
        params = dict(engine.module.named_parameters())
        if stage == 3:
            with zeroio.zero.GatheredParameters(list(params.values())):
                full = {n: p.detach().float().clone().tolist() for n, p in params.items()}
        else:
            full = {n: p.detach().float().clone().tolist() for n, p in params.items()}
        engine.close()
        out[stage] = (losses, full if rank == 0 else None)
    return out


def _check(world, tmp_path):
    import torch

    ref_losses, ref_params = _reference(world)
    results = run_ranks(_rank_body, world, str(tmp_path), timeout=300)
    assert max(abs(a - b) for a, b in zip(ref_losses, ref_losses[1:], strict=False)) > 1e-3  # test can fail
    for stage in (2, 3):
        per_rank = [r[stage][0] for r in results]
        assert all(p == per_rank[0] for p in per_rank), "ranks disagree on the mean loss"
        losses, full = results[0][stage]
        assert losses == pytest.approx(ref_losses, rel=2e-5), f"stage {stage} world {world}"
        for name, ref in ref_params.items():
            got = torch.tensor(full[name])
            err = (got - ref).abs().max().item()
            assert err < 5e-5, f"stage {stage} world {world}: {name} differs by {err}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_zeroio_matches_adamw_at_world(world, tmp_path):
    _check(world, tmp_path)
