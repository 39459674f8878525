"""zeroio's TrainingArguments / Trainer drop-in, one process: what each setting turns into.

- ``deepspeed=`` (dict, path, ``--deepspeed`` through HfArgumentParser) is the
  zeroio config and transformers' DeepSpeed path never runs.
- a stage-3 TrainingArguments makes ``from_pretrained`` run inside
  ``zeroio.zero.Init`` (a recording stand-in checks the model was built inside
  it, with the TrainingArguments "auto" values filled), only while the
  arguments live, never for stage 2.
- ``optim`` / ``lr_scheduler_type``: honoured where the config has no block,
  refused otherwise; never replaced.
- ``disable_tqdm`` silences zeroio's save bars; the stage/offload line is logged once.
- the accelerate process-count check against fabricated launcher command lines.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from zeroio.errors import ConfigError
from zeroio.testing import run_ranks

pytest.importorskip("transformers")

STAGE3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}
STAGE2 = {"zero_optimization": {"stage": 2}}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=16, num_hidden_layers=1, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32))


def _args(tmp_path, **kw):
    from zeroio.integrations.transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                learning_rate=1e-3, max_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


class _Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def _trainer(args, **kw):
    from zeroio.integrations.transformers import Trainer

    return Trainer(model=_model(), args=args, train_dataset=_Blocks(), **kw)


# ---- the deepspeed field -----------------------------------------------------------------------

def test_deepspeed_dict_and_path_are_the_zeroio_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(STAGE2))
    for given in (STAGE2, str(path)):
        args = _args(tmp_path, deepspeed=given)
        assert args.deepspeed is None and args.zeroio_config == given
        assert args.zeroio_raw == STAGE2
        assert getattr(args, "hf_deepspeed_config", None) is None
        assert args.deepspeed_plugin is None


def test_hf_argument_parser_reads_deepspeed_flag(tmp_path):
    from transformers import HfArgumentParser

    from zeroio.integrations.transformers import TrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(STAGE2))
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--deepspeed", str(path), "--use_cpu", "--report_to", "none"])
    assert isinstance(args, TrainingArguments) and args.zeroio_raw == STAGE2


def test_missing_config_file_and_both_fields_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _args(tmp_path, deepspeed=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="both deepspeed= and zeroio_config="):
        _args(tmp_path, deepspeed=STAGE2, zeroio_config=STAGE2)


def test_trainer_without_config_is_the_stock_trainer(tmp_path):
    trainer = _trainer(_args(tmp_path))
    trainer.train()
    assert trainer.zeroio_engine is None
    assert isinstance(trainer.optimizer, torch.optim.Optimizer)


# ---- stage 3: from_pretrained inside zero.Init --------------------------------------------------

class _RecordingInit:
    """Stands in for zeroio.zero.Init: records its config and the parameters built inside it."""

    calls: list[dict] = []

    def __init__(self, *, config):
        self.config = config
        self.count = 0

    def __enter__(self):
        from torch.nn.modules.module import register_module_parameter_registration_hook

        def hook(module, name, param):
            self.count += 1

        self._handle = register_module_parameter_registration_hook(hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        _RecordingInit.calls.append({"config": self.config, "params_built": self.count})
        return False


@pytest.fixture
def saved(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained", {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def recording(monkeypatch):
    import zeroio.partition.zero as zero

    _RecordingInit.calls = []
    monkeypatch.setattr(zero, "Init", _RecordingInit)
    yield _RecordingInit.calls
    from zeroio.integrations.transformers import deactivate_zero3

    deactivate_zero3()


def test_stage3_arguments_make_from_pretrained_run_inside_zero_init(tmp_path, saved, recording):
    from transformers import AutoModelForCausalLM

    path, weights = saved
    args = _args(tmp_path, deepspeed=STAGE3, per_device_train_batch_size=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(recording) == 1
    call = recording[0]
    assert call["params_built"] >= len(weights)  # the model was constructed inside the context
    cfg = call["config"]
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["fp16"]["enabled"] is False
    assert cfg["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999]}
    # what TrainingArguments cannot know stays "auto" for zero.Init (the model's hidden size)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert STAGE3["train_micro_batch_size_per_gpu"] == "auto"  # the user's dict is not modified
    # the stand-in partitions nothing: the load itself is the stock one
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n
    del args


def test_the_hook_lasts_as_long_as_the_stage3_arguments(tmp_path, saved, recording):
    from transformers import AutoModelForCausalLM

    from zeroio.integrations.transformers import deactivate_zero3

    path, _ = saved
    args = _args(tmp_path, deepspeed=STAGE2)
    AutoModelForCausalLM.from_pretrained(path)
    assert recording == []  # stage 2 loads whole
    args = _args(tmp_path, deepspeed=STAGE3)
    AutoModelForCausalLM.from_pretrained(path)
    assert len(recording) == 1
    del args
    gc.collect()
    AutoModelForCausalLM.from_pretrained(path)
    assert len(recording) == 1  # the arguments are gone: nothing leaks into later loads
    args = _args(tmp_path, deepspeed=STAGE3)
    deactivate_zero3()
    AutoModelForCausalLM.from_pretrained(path)
    assert len(recording) == 1
    del args


# ---- optim and lr_scheduler_type ----------------------------------------------------------------

def test_optim_sgd_without_optimizer_block_is_refused_not_replaced(tmp_path):
    with pytest.raises(ConfigError) as err:
        _trainer(_args(tmp_path, deepspeed=STAGE2, optim="sgd"))
    msg = str(err.value)
    assert "optim='sgd' is not supported" in msg and "adamw_torch" in msg and "Adam/AdamW" in msg
    assert err.value.key == "optim"


def test_optim_sgd_old_trainer_path_is_refused(tmp_path):
    from transformers import TrainingArguments

    from zeroio.integrations.transformers import ZeroIOTrainer

    args = TrainingArguments(output_dir=str(tmp_path), optim="sgd", use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="optim='sgd'"):
        ZeroIOTrainer(model=_model(), args=args, train_dataset=_Blocks(), zeroio_config=STAGE2)


def test_optim_contradicting_the_optimizer_block_is_refused(tmp_path):
    config = {**STAGE2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError, match="optim='adafactor' contradicts"):
        _trainer(_args(tmp_path, deepspeed=config, optim="adafactor"))
    with pytest.raises(ConfigError, match="optim_args"):
        _trainer(_args(tmp_path, deepspeed=STAGE2, optim_args="foo=1"))


def test_adamw_family_is_honoured_as_zeroio_adamw(tmp_path):
    trainer = _trainer(_args(tmp_path, deepspeed=STAGE2, optim="adamw_torch_fused",
                             adam_beta1=0.8, weight_decay=0.1))
    trainer.train()
    cfg = trainer.zeroio_engine.config
    assert cfg.optimizer.name == "adamw"
    assert list(cfg.optimizer.params["betas"]) == pytest.approx([0.8, 0.999])
    assert cfg.optimizer.params["weight_decay"] == pytest.approx(0.1)


def test_lr_scheduler_type_honoured_or_refused(tmp_path):
    trainer = _trainer(_args(tmp_path, deepspeed=STAGE2, lr_scheduler_type="constant"))
    trainer.train()
    sched = trainer.zeroio_engine.config.scheduler
    assert sched.type == "WarmupLR" and sched.params["warmup_num_steps"] == 0
    with pytest.raises(ConfigError, match="lr_scheduler_type='cosine' has no zeroio equivalent"):
        _trainer(_args(tmp_path, deepspeed=STAGE2, lr_scheduler_type="cosine"))
    block = {**STAGE2, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2}}}
    with pytest.raises(ConfigError, match="contradicts the zeroio config's scheduler.type"):
        _trainer(_args(tmp_path, deepspeed=block, lr_scheduler_type="constant"))


# ---- progress bars and the log line -------------------------------------------------------------

@pytest.mark.parametrize("disable", [True, False])
def test_disable_tqdm_governs_zeroio_save_bars(tmp_path, capfd, disable):
    trainer = _trainer(_args(tmp_path, deepspeed=STAGE3, disable_tqdm=disable))
    trainer.train()
    capfd.readouterr()
    trainer.save_model(str(tmp_path / "final"))
    err = capfd.readouterr().err
    assert ("save 16-bit model" in err) is (not disable)
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_trainer_log_states_stage_offload_and_placement_once(tmp_path):
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    trainer = _trainer(_args(tmp_path, deepspeed=config))
    logger = logging.get_logger("transformers.trainer")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        with CaptureLogger(logger) as cl:
            trainer.train()
            trainer.evaluate(_Blocks())
    finally:
        logger.setLevel(before)
    lines = [ln for ln in cl.out.splitlines() if ln.startswith("zeroio:")]
    assert len(lines) == 1
    assert "ZeRO stage 3 on 1 rank(s)" in lines[0]
    assert "offload_optimizer=cpu, offload_param=none" in lines[0]
    assert "optimizer state on cpu" in lines[0] and "parameters partitioned" in lines[0]


# ---- accelerate process count -------------------------------------------------------------------

ACC = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
MARK = {"ACCELERATE_MIXED_PRECISION": "no"}


def test_check_launch_compares_requested_processes_with_world_size(tmp_path):
    from zeroio.integrations.accelerate import check_launch

    check_launch({}, ["bash"])  # not started by accelerate: nothing to check
    check_launch({**MARK, "WORLD_SIZE": "2"}, [*ACC, "--num_processes", "2", "train.py"])
    # the script's own --num_processes after the script name is not accelerate's
    check_launch(MARK, [*ACC, "train.py", "--num_processes", "4"])
    with pytest.raises(ConfigError, match="asked for 2 processes but started 1") as err:
        check_launch(MARK, [*ACC, "--num_processes=2", "train.py"])
    assert "configs/accelerate-zeroio.yaml" in str(err.value)
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: NO\nnum_processes: 3\n")
    with pytest.raises(ConfigError, match="asked for 3 processes but started 2"):
        check_launch({**MARK, "WORLD_SIZE": "2"}, [*ACC, "--config_file", str(cfg), "t.py"])
    with pytest.raises(ConfigError, match="more than one process"):  # no /proc: the env tells
        check_launch({**MARK, "MASTER_ADDR": "127.0.0.1"}, [])
    with pytest.raises(ConfigError, match="distributed_type: DEEPSPEED") as err:
        check_launch({"ACCELERATE_USE_DEEPSPEED": "true"}, [])
    assert "TrainingArguments(deepspeed=...)" in str(err.value)


def _resize_partitioned(folder: str) -> str:
    from transformers import AutoModelForCausalLM

    from zeroio.integrations.transformers import TrainingArguments, deactivate_zero3

    args = TrainingArguments(output_dir=f"{folder}/out", deepspeed=STAGE3, report_to=[],
                             use_cpu=True)
    model = AutoModelForCausalLM.from_pretrained(f"{folder}/pretrained")  # partitioned
    try:
        model.resize_token_embeddings(80)
    except ConfigError as e:
        return str(e)
    finally:
        deactivate_zero3()
        del args
    return "resized"


def test_resize_of_a_partitioned_embedding_says_what_works(tmp_path, saved):
    """Stock run_clm.py resizes the embeddings; with zeroio's own classes at stage 3 the model
    is partitioned outside transformers' ZeRO-3 path, where transformers' resize cannot work:
    a ConfigError names the facade instead of transformers' 'not enough values to unpack'."""
    (msg,) = run_ranks(_resize_partitioned, 1, str(tmp_path))
    assert msg.startswith("resize_token_embeddings on a model zeroio's TrainingArguments loaded "
                          "partitioned (stage 3)")
    assert "import zeroio.integrations.transformers" in msg
