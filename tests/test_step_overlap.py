"""The overlapped host optimizer step (ZEROIO_OVERLAP_STEP=1, offload_optimizer cpu, stages 0-2).

The CPU Adam of each chunk is slowed down on purpose, so the next forward would read stale
parameters unless the partitioner's forward pre-hooks wait for exactly the chunks their module
depends on. Every run is compared with plain torch AdamW + clip_grad_norm_ on the same data;
a control run with the hooks removed must differ (the test can fail)."""

import pytest

from zeroio.testing import run_ranks

STEPS, LR, CLIP = 4, 1e-2, 0.5


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step, rank):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _train(stage, remove_hooks):
    import threading
    import time

    import torch
    import torch.distributed as dist

    import zeroio
    from zeroio.optim.adam import ShardedAdam

    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = zeroio.initialize(model=_model(), config=cfg)
    if remove_hooks:  # control: only the backward hooks stay
        n_grad = sum(len(b.slots) for b in engine.partitioner.layout.buckets)
        for h in engine.partitioner._hooks[n_grad:]:
            h.remove()
    released = threading.Event()
    log = {"returned_first": 0, "chunks": 0}
    begin = ShardedAdam.begin_chunked_step

    def slow_begin(self, grad_scale=1.0):
        chunked = begin(self, grad_scale)
        update = chunked.update

        def slow_update(gi, lo, k):
            if log["chunks"] == 0 and released.wait(timeout=30):
                log["returned_first"] += 1  # step() returned before the first chunk ran
            log["chunks"] += 1
            time.sleep(0.01)
            update(gi, lo, k)

        chunked.update = slow_update
        return chunked

    ShardedAdam.begin_chunked_step = slow_begin
    losses = []
    for step in range(STEPS):
        x, y = _data(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        released.clear()
        log["chunks"] = 0
        engine.step()
        released.set()
        losses.append(loss.item())
    engine.synchronize()
    params = [p.detach().reshape(-1).tolist() for p in engine.module.parameters()]
    engine.close()
    return losses, params, log["returned_first"]


def _reference(world):
    import torch

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        outs = [torch.nn.functional.mse_loss(model(_data(step, r)[0]), _data(step, r)[1])
                for r in range(world)]
        (sum(outs) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append([o.item() for o in outs])
    return losses, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 2), (2, 1)])
def test_overlapped_step_matches_torch(world, stage):
    import torch

    results = run_ranks(_train, world, stage, False, env={"ZEROIO_OVERLAP_STEP": "1"})
    ref_losses, ref_params = _reference(world)
    for rank, (losses, params, returned_first) in enumerate(results):
        assert returned_first == STEPS, "step() waited for the CPU optimizer"
        for step in range(STEPS):
            assert losses[step] == pytest.approx(ref_losses[step][rank], rel=1e-5, abs=1e-6)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(torch.tensor(p), q.reshape(-1), rtol=1e-5, atol=1e-6)


def test_without_the_forward_hooks_the_next_forward_reads_stale_parameters():
    results = run_ranks(_train, 1, 2, True, env={"ZEROIO_OVERLAP_STEP": "1"})
    ref_losses, _ = _reference(1)
    losses = results[0][0]
    assert any(abs(a - b[0]) > 1e-4 for a, b in zip(losses[1:], ref_losses[1:], strict=True))
