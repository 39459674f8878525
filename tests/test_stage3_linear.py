"""Stage 3's ``nn.Linear`` keeps the parameter for its backward, not a view of the gathered
buffer ([Note: linear layers keep the parameter] in zeroio/partition/stage3/linear.py).

- StageThreeLinear against ``F.linear``: output and the three gradients, 2-D and 3-D inputs,
  with and without bias, and under CPU autocast (bf16).
- The tiny Llama at stage 3: every tensor autograd saves during a forward is checked against
  the gathered buffers alive at that moment; none but the parameters themselves may point
  into one (a saved view keeps its buffer allocated until the backward). The same run with
  the swap switched off finds the transposed weights there, so the check can fail.
- On a GPU: the peak memory of a forward over 8 layers, with and without the swap.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zeroio
from zeroio.partition.stage3 import linear as lin
from zeroio.testing import models as M
from zeroio.testing.cuda import need_cuda


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = nn.Parameter(torch.randn(4, 7, generator=g, dtype=torch.float64))
    b = nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64)) if bias else None
    gy = torch.randn(*shape[:-1], 4, generator=g, dtype=torch.float64)
    outs = []
    for fn in (F.linear, lin.StageThreeLinear.apply):
        xi = x.clone().requires_grad_()
        for p in (w, b):
            if p is not None:
                p.grad = None
        y = fn(xi, w, b)
        y.backward(gy)
        outs.append((y.detach(), xi.grad, w.grad.clone(), None if b is None else b.grad.clone()))
    for ref, got in zip(outs[0], outs[1], strict=True):
        if ref is None:
            assert got is None
        else:
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_under_autocast_matches_f_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=g)
    w = nn.Parameter(torch.randn(8, 16, generator=g))
    grads = []
    for fn in (F.linear, lin.StageThreeLinear.apply):
        w.grad = None
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xi, w, None)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append((xi.grad, w.grad.clone()))
    for ref, got in zip(grads[0], grads[1], strict=True):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # bf16 matmuls


def _saved_views_of_gathered_buffers(monkeypatch, swap: bool) -> tuple[int, list[float]]:
    """Saved non-parameter tensors pointing into a live gathered buffer, over 2 steps."""
    if not swap:
        monkeypatch.setattr(lin.LinearSwap, "apply", lambda self, module: None)
    torch.manual_seed(0)
    model = M.tiny_llama(layers=3, checkpointing=False)
    cfg = M.stage3_config(micro=2, gas=1, clip=1.0, lr=1e-3, zero={
        **M.SMALL_STAGE3, "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 1000, "stage3_max_reuse_distance": 0,
        "offload_param": M.offload_param("cpu"), "offload_optimizer": M.offload_optimizer("cpu")})
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    groups = engine.partitioner.pgroups
    views = 0

    def pack(t):
        nonlocal views
        live = {g.full_flat().untyped_storage().data_ptr() for g in groups
                if g.full_flat() is not None}
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() in live:
            views += 1
        return t

    ids = torch.randint(0, M.VOCAB, (2, M.SEQ), generator=torch.Generator().manual_seed(3))
    losses = []
    try:
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close()
    return views, losses


def test_autograd_saves_no_view_of_a_gathered_buffer(monkeypatch):
    views, losses = _saved_views_of_gathered_buffers(monkeypatch, swap=True)
    assert views == 0
    with monkeypatch.context() as m:
        views_off, losses_off = _saved_views_of_gathered_buffers(m, swap=False)
    # F.linear saves weight.t(): one per Linear and step (7 per layer + the tied head)
    assert views_off >= 2 * (3 * 7 + 1), views_off
    assert losses == losses_off  # the same training either way


WIDTH, LAYERS = 2048, 8
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 2  # bf16 weight + bias


def _forward_peak(swap: bool, monkeypatch) -> int:
    if not swap:
        monkeypatch.setattr(lin.LinearSwap, "apply", lambda self, module: None)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
                            for _ in range(LAYERS)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 2 * WIDTH * (WIDTH + 1),
                                 "stage3_prefetch_bucket_size": WIDTH * (WIDTH + 1),
                                 "stage3_max_reuse_distance": 0}}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    x = torch.randn(4, WIDTH, device=engine.device, dtype=torch.bfloat16)
    try:
        for _ in range(2):  # the first step records the trace
            # the step done (with the overlap it runs beside this forward): what it keeps
            # on the GPU (the step assist's slots and resident chunks) is in the base
            engine.synchronize()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = engine(x).float().square().mean()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            engine.backward(loss)
            engine.step()
    finally:
        engine.close()
    return peak


@pytest.mark.gpu
def test_gpu_forward_does_not_keep_every_layer(monkeypatch):
    need_cuda(1)
    kept = _forward_peak(True, monkeypatch)
    with monkeypatch.context() as m:
        held = _forward_peak(False, m)
    # live groups (2 layers + the one being gathered) and a shard's H2D copy; activations of
    # 4 x 2048 are negligible. Without the swap every layer stays until its backward.
    assert kept <= 5 * LAYER_BYTES, (kept, held)
    assert held >= LAYERS * LAYER_BYTES, (kept, held)


def test_swap_keeps_the_module_usable_and_undoes(monkeypatch):
    """The swapped module is still an nn.Linear, prints as one, deep-copies, and gets its class
    back when the engine closes (hooks removed)."""
    import copy

    torch.manual_seed(0)
    model = M.tiny_llama(layers=1, checkpointing=False)
    cfg = M.stage3_config(micro=2, gas=1, clip=1.0, lr=1e-3, zero={
        **M.SMALL_STAGE3, "offload_param": M.offload_param("cpu"),
        "offload_optimizer": M.offload_optimizer("cpu")})
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is lin.StageThreeLinearModule and isinstance(q, nn.Linear)
    assert repr(q).startswith("Linear(")
    twin = copy.deepcopy(q)
    x = torch.randn(3, q.in_features)
    with zeroio.zero.GatheredParameters(list(q.parameters())):
        torch.testing.assert_close(q(x), F.linear(x, q.weight, q.bias))
        torch.testing.assert_close(twin(x), F.linear(x, q.weight, q.bias))
    engine.close()
    assert type(q) is nn.Linear
