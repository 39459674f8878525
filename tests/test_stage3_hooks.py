"""Stage-3 hook machinery against a replicated model, with plain gradients (no optimizer):
a parameter used twice in one forward, a module using another module's parameter,
reentrant activation checkpointing, inference under no_grad; what each rank holds
after init and between steps; GatheredParameters with a modifier rank.

Gradients are compared exactly up to fp32 summation order (2 ranks average their
micro-batch gradients; the reference backpropagates the mean of both losses):
tolerance 1e-6 against gradients of order 1e-1.
"""

from __future__ import annotations

from zeroio.testing import run_ranks


def _model():
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(x + torch.tanh(self.lin(torch.tanh(self.lin(x)))))  # lin used twice

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.out = nn.Linear(16, 16)

        def forward(self, ids):
            h = self.emb(ids)
            for b in self.blocks:
                h = checkpoint(b, h, use_reentrant=True) if self.training else b(h)
            h = self.out(h)
            return nn.functional.linear(h, self.emb.weight)  # another module's parameter

    torch.manual_seed(0)
    return Net()


def _flat_grads(part):
    import torch
    import torch.distributed as dist

    full = torch.zeros(part.index.total_numel)
    for sg in part.groups:
        for s in sg.segments:
            full[s.global_offset:s.global_offset + s.numel] = \
                sg.grad[s.local_offset:s.local_offset + s.numel]
    dist.all_reduce(full)
    return full


def _body():
    import copy

    import torch
    import torch.distributed as dist

    import zeroio
    from zeroio.partition.stage3 import Stage3Partitioner, Stage3Settings
    from zeroio.partition.stage12 import ShardHome

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ref = copy.deepcopy(model)
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    part = Stage3Partitioner(
        module=model, param_groups=[list(model.parameters())], compute_dtype=torch.float32,
        device=torch.device("cpu"), home=ShardHome(device=torch.device("cpu")),
        settings=Stage3Settings(persistence_threshold=20, prefetch_bucket_size=400,
                                max_reuse_distance=0))
    persistent = sum(g.plan.padded_numel * 4 for g in part.pgroups if g.plan.persistent)
    out = {"total": total_bytes, "persistent": persistent, "resident": [], "grad_err": [],
           "loss_err": []}
    out["resident"].append(part.resident_bytes())
    ids = torch.randint(0, 40, (2 * world, 5), generator=torch.Generator().manual_seed(3))
    mine = ids[2 * rank:2 * rank + 2]
    for _ in range(3):
        part.begin_micro_step(True)
        loss = model(mine).logsumexp(-1).mean()
        loss.backward()
        part.finalize_gradients(True)
        ref.zero_grad()
        rl = sum(ref(ids[2 * k:2 * k + 2]).logsumexp(-1).mean() for k in range(world)) / world
        rl.backward()
        refg = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        out["grad_err"].append(((_flat_grads(part) - refg).abs().max().item(),
                                refg.abs().max().item()))
        for sg in part.groups:
            sg.master -= 0.5 * sg.grad
        part.publish_params()
        part.zero_grad()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.5 * p.grad
        out["resident"].append(part.resident_bytes())
    model.eval()
    ref.eval()
    with torch.no_grad():
        want = ref(ids)
        out["loss_err"].append(((model(ids) - want).abs().max() / want.abs().max()).item())
    out["resident"].append(part.resident_bytes())
    # GatheredParameters: rank 0's change wins and reaches shards and fp32 masters
    w = model.blocks[1].lin.weight
    with zeroio.zero.GatheredParameters([w], modifier_rank=0):
        with torch.no_grad():
            w.fill_(0.5 if rank == 0 else 9.0)
    with zeroio.zero.GatheredParameters([w]):
        out["after_modify"] = (w.min().item(), w.max().item(), tuple(w.shape))
    out["after_release_numel"] = w.numel()
    entry = part.index.by_name()["blocks.1.lin.weight"]
    masters = torch.zeros(part.index.total_numel)
    for sg in part.groups:
        for s in sg.segments:
            masters[s.global_offset:s.global_offset + s.numel] = \
                sg.master[s.local_offset:s.local_offset + s.numel]
    dist.all_reduce(masters)
    out["master_w"] = masters[entry.offset:entry.offset + entry.numel].unique().tolist()
    part.close()
    return out


def test_hooks_residency_and_gathered_parameters():
    for r in run_ranks(_body, 2, timeout=120):
        for err, scale in r["grad_err"]:
            assert scale > 1e-2 and err < 1e-6, r["grad_err"]
        assert r["loss_err"][0] < 1e-6  # relative, fp32 summation order only
        # each rank's shards are half the model (plus padding) and nothing else is gathered
        # between steps except the persistent parameters
        for res in r["resident"]:
            assert res["gathered"] == r["persistent"], res
            assert abs(res["cpu"] - r["total"] / 2) <= 64 * 4, (res, r["total"])
        assert r["persistent"] > 0
        assert r["after_modify"] == (0.5, 0.5, (16, 16))
        assert r["after_release_numel"] == 0
        assert r["master_w"] == [0.5]
