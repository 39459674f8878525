"""Engine behaviour on 2 gloo ranks: fp16 overflow skipping, client optimizer/scheduler, errors."""

import math

import pytest

from zeroio.testing import run_ranks


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(step, rank):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _fp16_overflow(stage):
    import torch
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3,
                                                        "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10,
                                                        "warmup_type": "linear"}},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1,
                    "loss_scale_window": 100},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20}}
    engine, _, _, sched = zeroio.initialize(model=_mlp(), config=cfg)
    log = []
    for step in range(6):
        x, y = _data(step, rank)
        before = [p.detach().clone() for p in engine.module.parameters()]
        lr_before = engine.get_lr()[0]
        out = engine(x.half())
        loss = torch.nn.functional.mse_loss(out.float(), y)
        hook = None
        if step == 2 and rank == 1:  # one rank's gradients overflow
            hook = engine.module[0].weight.register_hook(lambda g: torch.full_like(g, math.inf))
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        engine.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
        log.append(dict(step=step, changed=changed, scale=engine.loss_scaler.scale,
                        applied=engine.was_step_applied(), lr_before=lr_before,
                        lr_after=engine.get_lr()[0], loss=loss.item()))
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    return log, engine.global_steps, engine.skipped_steps, flat.tolist()


def _client_optimizer_and_scheduler():
    """A client AdamW with two param groups and a client LambdaLR, vs the same in plain torch."""
    import torch
    import torch.distributed as dist

    import zeroio

    def groups(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    model, ref = _mlp(), _mlp()
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cfg = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}}
    engine, zopt, _, zsched = zeroio.initialize(model=model, config=cfg, optimizer=opt,
                                                lr_scheduler=sched)
    ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: 1.0 / (1 + s))
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(5):
        x, y = _data(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        xs, ys = zip(*(_data(step, r) for r in range(world)), strict=True)
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ropt.step()
        ropt.zero_grad()
        rsched.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return diff, zsched is sched, engine.get_lr(), rsched.get_last_lr()


def _config_errors():
    import torch

    import zeroio

    out = {}
    base = {"train_micro_batch_size_per_gpu": 1}
    for label, kwargs in {
        "onebitlamb": dict(config={**base, "optimizer": {"type": "OneBitLamb",
                                                         "params": {"lr": 1e-3}}}),
        "none": dict(config=base),
        # a client SGD with offload: refused while zero_force_ds_cpu_optimizer is true
        "sgd": dict(config={**base, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                    optimizer="sgd"),
    }.items():
        model = _mlp()
        if kwargs.get("optimizer") == "sgd":
            kwargs = dict(kwargs, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            zeroio.initialize(model=model, **kwargs)
            out[label] = None
        except zeroio.ConfigError as e:
            out[label] = (e.key, str(e))
    return out


def _frozen_layer_bf16():
    """A frozen first layer: cast to bf16 with the rest, never changed; the rest trains."""
    import torch

    import zeroio

    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    trained = [p.detach().clone() for p in model[2].parameters()]
    cfg = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    for step in range(2):
        x, y = _data(step, 0)
        engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    return dict(
        dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        frozen_same=all(torch.equal(a.bfloat16(), p) for a, p in zip(frozen, model[0].parameters(), strict=True)),
        trained_moved=all(not torch.equal(a.bfloat16(), p) for a, p in zip(trained, model[2].parameters(), strict=True)),
        index_names=[e.name for e in engine.partitioner.index.entries],
        group_params=[list(g.params) for g in engine.partitioner.groups])


def _body():
    return {"fp16": {s: _fp16_overflow(s) for s in (0, 1, 2)},
            "client": _client_optimizer_and_scheduler(), "errors": _config_errors(),
            "frozen": _frozen_layer_bf16()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 2, timeout=180)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(results, stage):
    logs = [r["fp16"][stage] for r in results]
    for log, global_steps, skipped, _ in logs:
        assert global_steps == 6 and skipped == 1
        bad = log[2]
        assert not bad["applied"] and not bad["changed"]
        assert bad["scale"] == log[1]["scale"] / 2          # hysteresis 1: halved at once
        assert bad["lr_after"] == bad["lr_before"]          # the schedule did not advance
        for entry in log[:2] + log[3:]:
            assert entry["applied"] and entry["changed"] and math.isfinite(entry["loss"])
        assert log[3]["lr_after"] > log[3]["lr_before"]     # training continues, schedule too
    assert logs[0][3] == logs[1][3]                   # both ranks hold the same weights


def test_client_optimizer_and_scheduler_drive_training(results):
    for diff, same_sched, lr, ref_lr in (r["client"] for r in results):
        assert same_sched
        assert diff < 1e-6
        assert lr == pytest.approx(ref_lr)


def test_config_errors_name_the_key(results):
    errors = results[0]["errors"]
    assert errors["onebitlamb"][0] == "optimizer.type" and "OneBitLamb" in errors["onebitlamb"][1]
    assert errors["none"][0] == "optimizer"
    assert errors["sgd"][0] == "zero_force_ds_cpu_optimizer" and "SGD" in errors["sgd"][1]


def test_frozen_parameters_keep_their_place_but_do_not_train(results):
    r = results[0]["frozen"]
    assert r["dtypes"] == ["torch.bfloat16"]
    assert r["frozen_same"] and r["trained_moved"]
    # the global flat order still lists every parameter; only trainable ones are sharded
    assert r["index_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # 18 trainable elements in one bucket, 9 per rank: rank 0 holds part of 2.weight only
    assert r["group_params"] == [["2.weight"]]
    assert results[1]["frozen"]["group_params"] == [["2.weight", "2.bias"]]
