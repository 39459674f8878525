"""The overlapped host optimizer step (offload_optimizer cpu, stages 0-2), turned on by
``zero_optimization.tiering.overlap_step`` or the ZEROIO_OVERLAP_STEP=1 override.

The CPU Adam of each chunk is slowed down on purpose, so the next forward would read stale
parameters unless the partitioner's forward pre-hooks wait for exactly the chunks their module
depends on. Every run is compared with plain torch AdamW + clip_grad_norm_ on the same data;
a control run with the hooks removed must differ (the test can fail)."""

import pytest

from zeroio.testing import run_ranks
from zeroio.testing.models import mlp_batch, mlp_reference, tiny_mlp

STEPS, LR, CLIP = 4, 1e-2, 0.5


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
    engine, _, _, _ = zeroio.initialize(model=tiny_mlp(), config=cfg)
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

        def slow_update(gi, lo, k, **kw):
            if log["chunks"] == 0 and released.wait(timeout=30):
                log["returned_first"] += 1  # step() returned before the first chunk ran
            log["chunks"] += 1
            time.sleep(0.01)
            update(gi, lo, k, **kw)

        chunked.update = slow_update
        return chunked

    ShardedAdam.begin_chunked_step = slow_begin
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
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
    return mlp_reference(world, STEPS, lr=LR, clip=CLIP)


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


# ---- the config key, and every engine API that reads parameters --------------------------

READERS = ("state_dict", "eval_forward", "gathered", "save_16bit_model", "save_checkpoint",
           "close")


def _reference_after_each_step(n):
    import torch

    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = []
    for step in range(n):
        x, y = mlp_batch(step, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def _readers_body(tmpdir):
    """One training step per reader; right after ``step()`` returns (the CPU Adam is held back
    0.3 s) the raw parameters are read (stale: the control) and then the reader's."""
    import os
    import time
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    import zeroio
    from zeroio.optim.adam import ShardedAdam

    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 40,
                                 "offload_optimizer": {"device": "cpu"},
                                 "tiering": {"overlap_step": True}}}
    engine, _, _, _ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    begin = ShardedAdam.begin_chunked_step

    def slow_begin(self, grad_scale=1.0):
        chunked = begin(self, grad_scale)
        update, first = chunked.update, [True]

        def slow_update(gi, lo, k, **kw):
            if first[0]:
                first[0] = False
                time.sleep(0.3)
            update(gi, lo, k, **kw)

        chunked.update = slow_update
        return chunked

    ShardedAdam.begin_chunked_step = slow_begin
    names = [n for n, _ in engine.module.named_parameters()]
    x_eval = mlp_batch(100, 0)[0]
    out = {"overlap": engine.partitioner.overlap_forward}
    for step, reader in enumerate(READERS):
        x, y = mlp_batch(step, 0)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        t = time.perf_counter()
        engine.step()
        returned = time.perf_counter() - t
        raw = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if reader == "state_dict":
            got = {k: v.clone() for k, v in engine.module.state_dict().items()}
        elif reader == "eval_forward":
            engine.eval()
            with torch.no_grad():
                got = engine(x_eval)
            engine.train()
        elif reader == "gathered":
            params = list(engine.module.parameters())
            with zeroio.zero.GatheredParameters(params):
                got = {n: p.detach().clone() for n, p in zip(names, params, strict=True)}
        elif reader == "save_16bit_model":
            folder = Path(tmpdir) / "16bit"
            engine.save_16bit_model(str(folder))
            got = {}
            for f in sorted(os.listdir(folder)):
                if f.endswith(".safetensors"):
                    got.update(load_file(str(folder / f)))
        else:  # save_checkpoint / close: afterwards the parameters are the updated ones
            if reader == "save_checkpoint":
                engine.save_checkpoint(str(Path(tmpdir) / "ckpt"))
            else:
                engine.close()
            got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        lists = {n: v.tolist() for n, v in raw.items()}  # tensors do not survive the queue
        got = got.tolist() if isinstance(got, torch.Tensor) else {
            n: v.tolist() for n, v in got.items()}
        out[reader] = dict(returned_s=returned, raw=lists, got=got)
    return out


def test_overlap_step_from_config_key_and_readers_wait(tmp_path):
    """``zero_optimization.tiering.overlap_step`` turns the overlap on without the environment
    variable, and every engine API that reads parameters after ``step()`` sees the updated
    values while a plain read right after ``step()`` does not (the control)."""
    import torch

    (out,) = run_ranks(_readers_body, 1, str(tmp_path), env={"ZEROIO_OVERLAP_STEP": ""})
    assert out["overlap"], "tiering.overlap_step did not turn the overlapped step on"
    ref = _reference_after_each_step(len(READERS))
    for step, reader in enumerate(READERS):
        r = out[reader]
        assert r["returned_s"] < 0.25, (reader, "step() waited for the CPU optimizer")
        before = ref[step - 1] if step else tiny_mlp().state_dict()
        raw = {n: torch.tensor(v) for n, v in r["raw"].items()}
        for n in before:  # control: read at once, the parameters are still the previous step's
            torch.testing.assert_close(raw[n], before[n], rtol=1e-5, atol=1e-6, msg=reader)
        assert max((raw[n] - ref[step][n]).abs().max().item() for n in before) > 1e-4, reader
        if reader == "eval_forward":
            model = tiny_mlp()
            model.load_state_dict(ref[step])
            with torch.no_grad():
                expected = model(mlp_batch(100, 0)[0])
            torch.testing.assert_close(torch.tensor(r["got"]), expected, rtol=1e-5, atol=1e-6)
            continue
        for n, want in ref[step].items():
            torch.testing.assert_close(torch.tensor(r["got"][n]), want, rtol=1e-5, atol=1e-6,
                                       msg=reader)


def test_environment_variable_overrides_the_config_key(monkeypatch):
    """ZEROIO_OVERLAP_STEP replaces the key when the config is loaded: the resolved tiering
    holds what training uses."""
    from zeroio.config import load_config
    from zeroio.config.zero import overlap_step_enabled

    def on():
        return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "tiering": {"overlap_step": True}}}).zero_optimization.tiering

    def off():
        return load_config({"train_micro_batch_size_per_gpu": 1}).zero_optimization.tiering

    monkeypatch.delenv("ZEROIO_OVERLAP_STEP", raising=False)
    assert overlap_step_enabled(on()) is True
    assert overlap_step_enabled(off()) is False
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "0")
    assert overlap_step_enabled(on()) is False
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "1")
    assert overlap_step_enabled(off()) is True
