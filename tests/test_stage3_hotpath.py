"""Stage 3's per-step hot path allocates nothing new and keeps gradients right
([Note: landing reduced gradients] in zeroio/partition/stage3/grads.py).

CPU (world 1, in process), against a plain PyTorch copy of the model:
- the gradient shards are the same tensors (same storage) every step and each step's
  reduced gradient equals the reference, with and without accumulation, including a
  group that got a gradient last step and none this step (it must read zero);
- with one micro step the squared norm is the one taken while consuming (no re-read of
  the shards), equal to the reference's; with accumulation the host fallback gives it.
GPU (``-m gpu``): after warm-up a step makes no new cudaHostAlloc (the caching host
allocator's ``num_host_alloc`` does not grow) and the backward makes no synchronizing
CUDA call (``torch.cuda.set_sync_debug_mode("warn")`` reports none).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zeroio.partition.stage3 import Stage3Partitioner, Stage3Settings
from zeroio.partition.stage12 import ShardHome


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 24)
        self.blocks = nn.ModuleList([nn.Linear(24, 24) for _ in range(3)])
        self.side = nn.ModuleList([nn.Linear(24, 24)])  # used only when asked
        self.out = nn.Linear(24, 32)

    def forward(self, ids, use_side=False):
        h = self.emb(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        if use_side:
            h = h + self.side[0](h)
        return self.out(h).logsumexp(-1).mean()


def _flat(part) -> torch.Tensor:
    full = torch.zeros(part.index.total_numel)
    for sg in part.groups:
        for s in sg.segments:
            full[s.global_offset:s.global_offset + s.numel] = \
                sg.grad[s.local_offset:s.local_offset + s.numel]
    return full


def _setup(device=torch.device("cpu"), home=None, offload="none"):
    import copy

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    part = Stage3Partitioner(
        module=model, param_groups=[list(model.parameters())], compute_dtype=torch.float32,
        device=device, home=home or ShardHome(device=torch.device("cpu")),
        settings=Stage3Settings(persistence_threshold=30, prefetch_bucket_size=1000,
                                max_reuse_distance=0, offload_device=offload))
    return model, ref, part


@pytest.mark.parametrize("gas", [1, 2])
def test_grads_land_in_the_same_buffers_and_match_reference(gas):
    model, ref, part = _setup()
    storages = [sg.grad.untyped_storage().data_ptr() for sg in part.groups]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        use_side = step == 1  # step 2 must see zeros for the side group written in step 1
        ref.zero_grad()
        for micro in range(gas):
            ids = torch.randint(0, 32, (3, 5), generator=gen)
            boundary = micro == gas - 1
            part.begin_micro_step(boundary)
            model(ids, use_side).backward()
            part.finalize_gradients(boundary)
            ref(ids, use_side).backward()
        want = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in ref.parameters()])
        got = _flat(part)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters()
                     if p.grad is not None)
        assert part.landing.sq_norm() is None if gas > 1 else part.landing.sq_norm() is not None
        assert float(part.local_grad_sq_norm()) == pytest.approx(ref_sq, rel=1e-5)
        part.publish_params()
        part.zero_grad()
        assert [sg.grad.untyped_storage().data_ptr() for sg in part.groups] == storages
    assert part.landing.host_allocations == 0  # same device: accumulation adds in place
    part.close()


def _gpu_step(model, part, ids):
    part.begin_micro_step(True)
    model(ids).backward()
    part.finalize_gradients(True)
    part.local_grad_sq_norm()
    part.publish_params()
    part.zero_grad()


@pytest.mark.gpu
def test_gpu_step_makes_no_pinned_allocation_and_backward_no_sync():
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("needs CUDA")
    from zeroio.partition.stage12 import host_home

    dev = torch.device("cuda", 0)
    model, _, part = _setup(dev, host_home(True), offload="cpu")
    ids = torch.randint(0, 32, (3, 5), device=dev)
    for _ in range(3):  # warm-up: trace recorded, caches filled
        _gpu_step(model, part, ids)
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    allocs = part.landing.host_allocations
    part.begin_micro_step(True)
    loss = model(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    part.finalize_gradients(True)
    part.local_grad_sq_norm()
    part.publish_params()
    part.zero_grad()
    torch.cuda.synchronize()
    # torch announces the debug mode itself with a "prototype feature" warning; the
    # warnings that count are the ones naming a synchronizing CUDA call.
    syncs = [str(w.message) for w in caught
             if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
    assert syncs == [], syncs
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == before
    assert part.landing.host_allocations == allocs
    part.close()
