"""``zeroio.deepspeed``: DeepSpeed's ``initialize``, ``add_config_arguments``, ``init_distributed``
and ``zero.Init`` signatures, and the two ZeRO configs of the Hugging Face DeepSpeed docs.

References: DeepSpeed's documented behaviour (argument group, config precedence,
``Init`` keyword arguments) and plain PyTorch for training.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import pytest
import torch

from zeroio.config import ConfigWarning, load_config, load_init_config
from zeroio.config.script import load_script_config
from zeroio.errors import ConfigError
from zeroio.testing import run_ranks

# The ZeRO-2 and ZeRO-3 configs of the Hugging Face DeepSpeed integration docs, as published
# (the scheduler of their "optimizer and scheduler" section: WarmupDecayLR, "auto" steps).
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **copy.deepcopy({k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"}),
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
}


# ---- add_config_arguments ---------------------------------------------------------------------

def test_add_config_arguments_adds_deepspeeds_group():
    from zeroio.deepspeed import add_config_arguments

    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    group = next(g for g in parser._action_groups if g.title == "DeepSpeed")
    flags = {s for a in group._group_actions for s in a.option_strings}
    assert flags == {"--deepspeed", "--deepspeed_config", "--deepscale", "--deepscale_config"}
    a = parser.parse_args([])
    assert (a.deepspeed, a.deepspeed_config, a.deepscale, a.deepscale_config) == \
        (False, None, False, None)
    a = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert a.deepspeed is True and a.deepspeed_config == "ds.json"


# ---- which config initialize reads ------------------------------------------------------------

def test_config_from_args_or_call_and_both_is_an_error(tmp_path, monkeypatch):
    from zeroio.deepspeed.api import _pick_config

    monkeypatch.chdir(tmp_path)
    ns = argparse.Namespace
    assert _pick_config(ns(deepspeed_config="a.json"), None, None) == "a.json"
    assert _pick_config(ns(deepscale_config="old.json"), None, None) == "old.json"
    assert _pick_config(None, None, {"x": 1}) == {"x": 1}  # config_params, kept for old code
    # the same file spelled two ways is one config
    assert _pick_config(ns(deepspeed_config="a.json"), str(tmp_path / "a.json"), None) == "a.json"
    with pytest.raises(ConfigError, match=r"two DeepSpeed configs.*a\.json.*b\.json"):
        _pick_config(ns(deepspeed_config="a.json"), "b.json", None)
    with pytest.raises(ConfigError, match="--deepscale_config .* and --deepspeed_config"):
        _pick_config(ns(deepspeed_config="a.json", deepscale_config="b.json"), None, None)
    with pytest.raises(ConfigError, match="--deepspeed_config FILE"):
        _pick_config(ns(deepspeed_config=None), None, None)


# ---- the Hugging Face docs' configs -----------------------------------------------------------

def test_zero_init_reads_the_hf_zero3_config_whose_scheduler_is_auto():
    cfg = load_init_config(HF_ZERO3, world_size=2)
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.offload_param.device.value == "cpu"
    assert cfg.optimizer is None and cfg.scheduler is None  # not what partitioning reads
    assert not cfg.fp16.enabled  # "auto": the default, the model's own dtype
    # DeepSpeed's defaults for the bucket keys without a hidden size; the model's with one
    assert zero.reduce_bucket_size == 500_000_000
    assert load_init_config(HF_ZERO3, hidden_size=64).zero_optimization.reduce_bucket_size == 4096
    with pytest.raises(ConfigError, match="total_num_steps"):
        load_config(HF_ZERO3, world_size=2, learning_rate=1e-4, per_device_train_batch_size=1,
                    gradient_accumulation_steps=1, adam_beta1=0.9, adam_beta2=0.999,
                    adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, fp16=False,
                    warmup_steps=0)


@pytest.mark.parametrize("docs", [HF_ZERO2, HF_ZERO3], ids=["zero2", "zero3"])
def test_a_script_without_trainer_reads_the_hf_configs(docs):
    with pytest.raises(ConfigError, match=r'optimizer\.params\.lr is "auto".*learning_rate'):
        load_script_config(docs, world_size=2)
    own = copy.deepcopy(docs)
    own["optimizer"]["params"]["lr"] = 3e-4
    with pytest.raises(ConfigError, match=r'warmup_num_steps is "auto"'):
        load_script_config(own, world_size=2)
    own["scheduler"]["params"].update(warmup_num_steps=10, total_num_steps=100)
    with pytest.warns(ConfigWarning, match="gradient_clipping") as caught:
        cfg = load_script_config(own, world_size=2, hidden_size=8)
    text = str(caught[0].message)
    assert "train_micro_batch_size_per_gpu" in text and "optimizer.params.betas" in text
    # the run fills: world size, warmup peak = the config's lr (the Trainer's rule), buckets
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (2, 1, 1)
    assert cfg.scheduler.params["warmup_max_lr"] == 3e-4
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0
    assert cfg.optimizer.params["lr"] == 3e-4 and cfg.optimizer.params["betas"] == [0.9, 0.999]
    assert cfg.gradient_clipping == 0.0 and not cfg.fp16.enabled
    if docs is HF_ZERO3:
        assert cfg.zero_optimization.reduce_bucket_size == 64
    with pytest.raises(ConfigError, match="training_data"):
        load_script_config(own, world_size=2, builds_loader=True)
    # a client optimizer and schedule replace the config's blocks and their "auto" keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_script_config(docs, world_size=2, client_optimizer=True,
                                 client_scheduler=True)
    assert cfg.optimizer is None and cfg.scheduler is None


# ---- initialize and zero.Init on ranks --------------------------------------------------------

def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))


def _data(steps=4):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 5, generator=g) for _ in range(steps)]
    return [(x, x.sum(dim=1, keepdim=True).cos()) for x in xs]


def _plain_losses(lr=0.02):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out = []
    for x, y in _data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out


def _ds_callables(stage):
    import zeroio.deepspeed as deepspeed

    args = argparse.Namespace(local_rank=-1, deepspeed_config=None)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    engine, opt, loader, sched = deepspeed.initialize(
        args=args, model=_net(), config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.0),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)))
    out = []
    for x, y in _data():
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return {"losses": out, "local_rank": args.local_rank, "loader": loader,
            "sched": type(sched).__name__}


@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_with_optimizer_and_scheduler_callables_trains_like_pytorch(stage):
    (r,) = run_ranks(_ds_callables, 1, stage)
    assert r["losses"] == pytest.approx(_plain_losses(), rel=1e-5, abs=1e-7)
    assert r["local_rank"] == 0  # set from the launcher's LOCAL_RANK, as DeepSpeed does
    assert r["loader"] is None and r["sched"] == "LambdaLR"


def _zero_init_kwargs():
    import zeroio.deepspeed as deepspeed
    from zeroio.partition.stage3 import registry

    out = {}
    ref = _net()
    full = [p.detach().clone() for p in ref.parameters()]
    # module=: an already-built model partitioned now, as if built inside
    model = _net()
    init = deepspeed.zero.Init(module=model, remote_device="cpu", pin_memory=True)
    out["emptied"] = all(p.numel() == 0 and p in registry.INIT_SHARDS for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["gathered_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), full, strict=True))
    out["remote"] = (init.remote_device, init.pin_memory)
    with deepspeed.zero.Init(enabled=False, remote_device="nvme"):  # no-op: nothing checked
        m = _net()
    out["disabled_full"] = all(p.numel() > 0 for p in m.parameters())
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                               "nvme_path": "/tmp"}}}
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu",
                             dtype=torch.bfloat16) as init:
        m = _net()
    out["config_wins"] = init.remote_device
    out["bf16"] = all(registry.INIT_SHARDS[p].dtype == torch.bfloat16 for p in m.parameters())
    with deepspeed.zero.Init(config=HF_ZERO3) as init:  # the deprecated spelling
        _net()
    out["hf_zero3"] = init.config.zero_optimization.stage

    class MPU:
        def get_data_parallel_group(self):
            return None  # the world

    with deepspeed.zero.Init(mpu=MPU()):
        m = _net()
    out["mpu_shard"] = registry.INIT_SHARDS[next(m.parameters())].shard.numel()
    errors = []
    for kwargs in ({"remote_device": "nvme"}, {"zero_quantized_weights": True},
                   {"remote_device": "disk"}, {"config": {}, "config_dict_or_path": {}}):
        try:
            deepspeed.zero.Init(**kwargs)
        except ConfigError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_zero_init_takes_deepspeeds_keyword_arguments():
    r0, r1 = run_ranks(_zero_init_kwargs, 2)
    for r in (r0, r1):
        assert r["emptied"] and r["gathered_equal"] and r["disabled_full"]
        assert r["remote"] == ("cpu", True)
        assert r["config_wins"] == "nvme" and r["bf16"] and r["hf_zero3"] == 3
        assert r["mpu_shard"] == -(-7 * 5 // 2)  # fc1.weight split over the 2 ranks
        e = r["errors"]
        assert len(e) == 4
        assert "remote_device='nvme'" in e[0] and "nvme_path" in e[0]
        assert "zero_quantized_weights" in e[1] and "not implemented" in e[1]
        assert "disk" in e[2] and "config_dict_or_path" in e[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_init_distributed_backend_without_cuda():
    from zeroio.deepspeed.api import _backend

    assert _backend(None) == "gloo" and _backend("gloo") == "gloo"
    with pytest.warns(ConfigWarning, match="no CUDA on this machine, joining with gloo"):
        assert _backend("nccl") == "gloo"  # a GPU script on a CPU machine still runs
    with pytest.raises(ConfigError, match="'mpi'.*nccl or gloo"):
        _backend("mpi")
