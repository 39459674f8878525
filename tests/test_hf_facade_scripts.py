"""Scripts written for DeepSpeed through the Hugging Face stack run unchanged on zeroio.

The scripts in tests/scripts/ are written here in the style of the stock examples
(transformers' run_clm, TRL's sft/dpo, accelerate's DeepSpeed loop). Each runs on 2
CPU ranks at ZeRO stage 3 with the ``deepspeed`` facade first on ``PYTHONPATH`` (what
``zeroio launch`` does), so transformers/accelerate/TRL take their own DeepSpeed code
paths (partitioned ``from_pretrained``, ``resize_token_embeddings`` under
``GatheredParameters``, ``generate(synced_gpus=True)``, ``deepspeed.initialize``).

References: the same script without DeepSpeed (plain DDP, ``--use_cpu``) — its
losses, its saved weights (``from_pretrained`` of both folders) and greedy decoding
of its model in this process; the parameter count of that model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

# each script run starts 2 ranks that import transformers (and TRL / datasets)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

from zeroio.testing import hf_ds_configs  # noqa: E402
from zeroio.testing.hf_scripts import (  # noqa: E402
    SCRIPTS,
    accelerate_launch,
    script_env,
    tiny_causal_lm,
    torchrun,
    train_losses,
    write_corpus,
    write_preferences,
    zeroio_launch,
)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_facade")
    tiny_causal_lm(tmp / "model")  # vocab 24 < tokenizer 30: run_clm resizes
    tiny_causal_lm(tmp / "model32", vocab_size=32)  # TRL/accelerate scripts do not resize
    write_corpus(tmp / "train.txt")
    write_corpus(tmp / "valid.txt", repeats=2)
    write_preferences(tmp / "pref.jsonl")
    # DeepSpeed's HF docs ZeRO-3 config (offload to cpu, "auto" everywhere), the Trainer's
    # own optimizer and schedule (no optimizer/scheduler blocks) so DDP is the same run
    z3 = hf_ds_configs.zero3_hf_optimizer(str(tmp))
    del z3["fp16"]
    (tmp / "z3.json").write_text(json.dumps(z3))
    z3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp / "z3_nogather.json").write_text(json.dumps(z3))
    return tmp


_CLM_ARGS = ["--do_train", "--do_eval", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", "2", "--max_steps", "6", "--learning_rate", "3e-3",
             "--warmup_steps", "2", "--logging_steps", "1", "--report_to", "none",
             "--disable_tqdm", "true", "--seed", "0", "--eval_strategy", "steps",
             "--eval_steps", "3", "--save_steps", "3", "--load_best_model_at_end", "true",
             "--metric_for_best_model", "eval_loss", "--log_level", "info"]


def _clm(work: Path, out: str, *extra: str, facade: bool, script: str = "run_clm.py"):
    args = ["--model_name_or_path", str(work / "model"), "--train_file", str(work / "train.txt"),
            "--validation_file", str(work / "valid.txt"), "--output_dir", str(work / out),
            *_CLM_ARGS, *extra]
    if facade and script == "run_clm.py":  # the stock script, unchanged, as DeepSpeed users run it
        return zeroio_launch(SCRIPTS / script, args, script_env(facade=False, tmp=work))
    return torchrun(SCRIPTS / script, args, script_env(facade=facade, tmp=work))


@pytest.fixture(scope="module")
def clm(work):
    z3 = _clm(work, "clm_z3", "--deepspeed", str(work / "z3.json"), "--generate_after",
              facade=True)
    ddp = _clm(work, "clm_ddp", "--use_cpu", facade=False)
    # the one import line under plain torchrun (no facade on the path), resuming the
    # stage-3 run's step-3 checkpoint, with stage3_gather_16bit_weights_on_model_save false
    resumed = _clm(work, "clm_resumed", "--deepspeed", str(work / "z3_nogather.json"),
                   "--resume_from_checkpoint", str(work / "clm_z3" / "checkpoint-3"),
                   facade=False, script="run_clm_one_import.py")
    return {"z3": z3, "ddp": ddp, "resumed": resumed}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_run_clm_stage3_losses_equal_ddp(work, clm):
    z3, ddp = train_losses(work / "clm_z3"), train_losses(work / "clm_ddp")
    assert len(z3) == 6
    assert z3 == pytest.approx(ddp, rel=1e-5)
    evals = [json.loads((work / d / "eval_results.json").read_text())["eval_loss"]
             for d in ("clm_z3", "clm_ddp")]
    assert evals[0] == pytest.approx(evals[1], rel=1e-5)


def test_run_clm_stage3_saved_model_reloads_equal_to_ddp(work, clm):
    z3, ddp = _weights(work / "clm_z3"), _weights(work / "clm_ddp")
    assert z3["model.embed_tokens.weight"].shape[0] == 30  # resized under ZeRO-3
    assert z3.keys() == ddp.keys()
    for name in z3:
        torch.testing.assert_close(z3[name], ddp[name], rtol=1e-4, atol=1e-6, msg=name)


def test_run_clm_stage3_counts_real_parameters(work, clm):
    real = sum(t.numel() for t in _weights(work / "clm_ddp").values())
    logged = re.findall(r"Number of trainable parameters = ([\d,]+)", clm["z3"].stdout
                        + clm["z3"].stderr)
    assert logged and int(logged[0].replace(",", "")) == real


def test_run_clm_stage3_generate_synced_gpus_matches_greedy_reference(work, clm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(work / "clm_ddp").eval()
    tok = AutoTokenizer.from_pretrained(work / "clm_ddp")
    prompt = tok("the", return_tensors="pt")
    for rank in (0, 1):  # the ranks stop at different lengths
        got = json.loads((work / "clm_z3" / f"generated_rank{rank}.json").read_text())
        assert got["zero3"] is True
        with torch.no_grad():
            want = model.generate(**prompt, max_new_tokens=4 + 3 * rank, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
        assert got["ids"] == want[0].tolist()


def test_one_import_resumes_and_warns_with_consolidate_command(work, clm):
    resumed, full = train_losses(work / "clm_resumed"), train_losses(work / "clm_z3")
    assert resumed[3:] == pytest.approx(full[3:], rel=1e-5)
    out = work / "clm_resumed"
    assert f"zeroio consolidate {out} {out}/model" in clm["resumed"].stderr + clm["resumed"].stdout
    assert not (out / "model.safetensors").exists()
    assert list(out.glob("global_step*"))  # the sharded checkpoint, as DeepSpeed writes


_TRL_ARGS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
             "--max_steps", "4", "--learning_rate", "3e-3", "--logging_steps", "1",
             "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
             "--seed", "0", "--max_length", "32", "--bf16", "false"]


@pytest.mark.parametrize("script,data", [("trl_sft.py", "train.txt"), ("trl_dpo.py", "pref.jsonl")])
def test_trl_trainer_stage3_equals_ddp(work, script, data):
    runs = {}
    for name, extra, facade in (("z3", ["--deepspeed", str(work / "z3.json")], True),
                                ("ddp", ["--use_cpu"], False)):
        out = work / f"{script[:-3]}_{name}"
        run = zeroio_launch if facade else torchrun  # TRL unchanged under zeroio launch
        run(SCRIPTS / script, ["--model_name_or_path", str(work / "model32"),
                               "--train_file", str(work / data), "--output_dir", str(out),
                               *_TRL_ARGS, *extra], script_env(facade=False, tmp=work))
        runs[name] = out
    assert len(train_losses(runs["z3"])) == 4
    assert train_losses(runs["z3"]) == pytest.approx(train_losses(runs["ddp"]), rel=1e-5)
    z3, ddp = _weights(runs["z3"]), _weights(runs["ddp"])
    for name in ddp:
        torch.testing.assert_close(z3[name], ddp[name], rtol=1e-4, atol=1e-6, msg=name)


_ACCELERATE_DS = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: true
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
use_cpu: false
"""

def test_accelerate_deepspeed_config_file_stage3_equals_ddp(work):
    ds = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
          "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    (work / "acc_ds.json").write_text(json.dumps(ds))
    (work / "acc_ds.yaml").write_text(_ACCELERATE_DS.format(config=work / "acc_ds.json"))
    args = ["--model_name_or_path", str(work / "model32"), "--train_file", str(work / "train.txt")]
    for name in ("ds", "plugin", "ddp"):
        (work / f"acc_{name}").mkdir()
    accelerate_launch(work / "acc_ds.yaml", SCRIPTS / "accelerate_train.py",
                      [*args, "--output_dir", str(work / "acc_ds")],
                      script_env(facade=True, tmp=work))
    # the same script with its DeepSpeedPlugin built in code, unchanged under zeroio launch
    zeroio_launch(SCRIPTS / "accelerate_train.py",
                  [*args, "--output_dir", str(work / "acc_plugin"), "--deepspeed_config_file",
                   str(work / "acc_ds.json")], script_env(facade=False, tmp=work))
    torchrun(SCRIPTS / "accelerate_train.py", [*args, "--output_dir", str(work / "acc_ddp"), "--cpu"],
             script_env(facade=False, tmp=work))  # the reference: plain DDP over gloo
    runs = ("ds", "plugin", "ddp")
    losses = {n: json.loads((work / f"acc_{n}" / "losses.json").read_text()) for n in runs}
    ddp = _weights(work / "acc_ddp")
    for run in ("ds", "plugin"):
        assert len(losses[run]) == 8
        assert losses[run] == pytest.approx(losses["ddp"], rel=1e-5), run
        z3 = _weights(work / f"acc_{run}")
        for name in ddp:
            torch.testing.assert_close(z3[name], ddp[name], rtol=1e-4, atol=1e-6,
                                       msg=f"{run}: {name}")
