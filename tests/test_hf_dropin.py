"""A DeepSpeed-style Transformers script on zeroio, changed in its import line only.

The script below (``DEEPSPEED_SCRIPT``) is what a DeepSpeed user runs with
``--deepspeed ds_config_zero3.json``; the zeroio version is the same text with
``from transformers import Trainer, TrainingArguments`` replaced by zeroio's
import. It is launched by ``accelerate launch --config_file
configs/accelerate-zeroio.yaml`` (2 CPU processes), reads the config through
``HfArgumentParser`` (``--deepspeed``), fine-tunes a model saved with
``save_pretrained`` using Hugging Face's seed ZeRO-3 config (every value
"auto"), and saves with ``save_model``. References: plain transformers
``from_pretrained`` of the saved folder against the engine's own parameters
gathered after training (written by an instrumentation epilogue appended to
the script, outside the compared text); the loss history.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.testing.multirank import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")

# Hugging Face's ds_config_zero3.json (docs/source/en/deepspeed.md), "auto" wherever it has one.
SEED_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# ... and its ds_config_zero2.json.
SEED_ZERO2 = {
    **{k: v for k, v in SEED_ZERO3.items() if k != "zero_optimization"},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}

DEEPSPEED_IMPORT = "from transformers import Trainer, TrainingArguments\n"
ZEROIO_IMPORT = "from zeroio.integrations.transformers import Trainer, TrainingArguments\n"

DEEPSPEED_SCRIPT = '''"""Fine-tune a causal LM (run with --deepspeed ds_config.json)."""
import json
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser
from transformers import Trainer, TrainingArguments


@dataclass
class ScriptArguments:
    model_path: str = field(metadata={"help": "a save_pretrained folder"})
    data_path: str = field(metadata={"help": "JSON list of token-id blocks"})


class Blocks(torch.utils.data.Dataset):
    def __init__(self, path):
        self.blocks = json.load(open(path))

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids = torch.tensor(self.blocks[i])
        return {"input_ids": ids, "labels": ids.clone()}


parser = HfArgumentParser((ScriptArguments, TrainingArguments))
script_args, training_args = parser.parse_args_into_dataclasses()
model = AutoModelForCausalLM.from_pretrained(script_args.model_path)
trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(script_args.data_path))
trainer.train()
trainer.save_model(training_args.output_dir + "/final")
'''

# Test instrumentation, put before the compared text: counts what zeroio's ranged safetensors
# reader reads (a partitioned from_pretrained reads each rank's part of each tensor).
PROLOGUE = '''
import zeroio.io.safetensors_reader as _reader
_READS = {"reads": 0, "bytes": 0, "largest": 0}
_read_range = _reader.SafetensorsReader.read_range


def _counting_read_range(self, key, lo=0, count=None, *args, **kwargs):
    out = _read_range(self, key, lo, count, *args, **kwargs)
    nbytes = out.numel() * out.element_size()
    _READS.update(reads=_READS["reads"] + 1, bytes=_READS["bytes"] + nbytes,
                  largest=max(_READS["largest"], nbytes))
    return out


_reader.SafetensorsReader.read_range = _counting_read_range
'''

# Test instrumentation, appended after the compared text: what each rank saw, and the engine's
# parameters gathered (the reference save_model's output must equal).
EPILOGUE = '''
import os
import zeroio
from safetensors.torch import save_file

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
engine = trainer.zeroio_engine
params = dict(engine.module.named_parameters())
with zeroio.zero.GatheredParameters(list(params.values())):
    full = {n: p.detach().clone().contiguous() for n, p in params.items()}
out = training_args.output_dir
json.dump({"rank": rank, "world": world, "engine_world": engine.world_size,
           "stage": engine.config.zero_optimization.stage,
           "shard_numel": sum(p.numel() for p in params.values()),
           "reads": _READS, "full_bytes": {n: t.numel() * t.element_size() for n, t in full.items()},
           "history": trainer.state.log_history}, open(f"{out}/rank{rank}.json", "w"))
if rank == 0:
    save_file(full, f"{out}/gathered.safetensors")
# Leave the process group before the interpreter finalizes: a gloo world left to finalization
# can abort a rank at exit ("terminate called without an active exception"), after everything
# above is written, which fails the launcher; not what this test checks.
import torch.distributed as dist
dist.destroy_process_group()
'''


def _tiny_pretrained(path: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False))
    model.save_pretrained(path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _blocks(path: Path, n: int = 320, seq: int = 32) -> None:
    from zeroio.cli.train.data import ByteTokenizer, builtin_corpus

    tokens = ByteTokenizer().encode(builtin_corpus())[: n * seq]
    path.write_text(json.dumps([tokens[i * seq:(i + 1) * seq].tolist() for i in range(n)]))


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _script_args(tmp: Path, out: Path, config: str = "ds_config_zero2.json") -> list[str]:
    return ["--model_path", str(tmp / "pretrained"), "--data_path", str(tmp / "blocks.json"),
            "--deepspeed", str(tmp / config), "--output_dir", str(out),
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--learning_rate", "3e-3", "--max_steps", "20", "--warmup_steps", "2",
            "--logging_steps", "4", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
            "--save_strategy", "no", "--seed", "0"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropin")
    initial = _tiny_pretrained(tmp / "pretrained")
    _blocks(tmp / "blocks.json")
    (tmp / "ds_config_zero3.json").write_text(json.dumps(SEED_ZERO3))
    (tmp / "ds_config_zero2.json").write_text(json.dumps(SEED_ZERO2))
    script = DEEPSPEED_SCRIPT.replace(DEEPSPEED_IMPORT, ZEROIO_IMPORT)
    (tmp / "train.py").write_text(PROLOGUE + script + EPILOGUE)
    return tmp, initial


def test_script_differs_from_the_deepspeed_one_in_the_import_line_only():
    zeroio_script = DEEPSPEED_SCRIPT.replace(DEEPSPEED_IMPORT, ZEROIO_IMPORT)
    a, b = DEEPSPEED_SCRIPT.splitlines(), zeroio_script.splitlines()
    assert len(a) == len(b)
    assert [(x, y) for x, y in zip(a, b, strict=True) if x != y] == [
        (DEEPSPEED_IMPORT.strip(), ZEROIO_IMPORT.strip())]


def _launch(tmp: Path, config: str) -> Path:
    out = tmp / config.removesuffix(".json")
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / "configs/accelerate-zeroio.yaml"),
           "--main_process_port", str(free_port()), str(tmp / "train.py"),
           *_script_args(tmp, out, config)]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def _check_trained(out: Path, initial: dict[str, torch.Tensor], stage: int) -> None:
    """Both ranks ran one engine; loss fell; save_model's folder is the gathered engine weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["engine_world"], r["stage"]) for r in ranks] == [
        (0, 2, 2, stage), (1, 2, 2, stage)]
    losses = [h["loss"] for h in ranks[0]["history"] if "loss" in h]
    assert len(losses) == 5
    assert losses[-1] < losses[0] - 0.3
    gathered = load_file(out / "gathered.safetensors")
    saved = AutoModelForCausalLM.from_pretrained(out / "final")
    state = dict(saved.named_parameters())
    assert sorted(state) == sorted(gathered) == sorted(initial)
    for name, value in gathered.items():
        assert torch.equal(state[name].detach(), value), name
    # it trained from the pretrained weights: every tensor moved, none far
    moved = [(gathered[n] - initial[n]).abs().max().item() for n in initial]
    assert min(moved) > 0 and max(moved) < 1.0


@pytest.mark.slow
def test_dropin_script_under_accelerate_config_trains_two_ranks_and_saves(workdir):
    tmp, initial = workdir
    out = _launch(tmp, "ds_config_zero2.json")
    _check_trained(out, initial, stage=2)


@pytest.mark.slow
def test_dropin_script_zero3_loads_pretrained_partitioned_and_trains(workdir):
    tmp, initial = workdir
    out = _launch(tmp, "ds_config_zero3.json")
    _check_trained(out, initial, stage=3)
    # the script's from_pretrained ran after TrainingArguments, so it loaded straight into
    # shards: each rank read its own part of each tensor from the file (no read as large as
    # the largest tensor; about half of the model's bytes per rank, plus the small
    # persistent tensors read whole), and nothing through the stage-2 path (no reads)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    sizes = ranks[0]["full_bytes"]
    for r in ranks:
        reads = r["reads"]
        assert reads["reads"] > 0, reads
        assert reads["largest"] < max(sizes.values()), (reads, max(sizes.values()))
        assert reads["bytes"] < 0.75 * sum(sizes.values()), (reads, sum(sizes.values()))


def test_accelerate_asked_for_two_processes_without_multi_gpu_is_an_error(workdir):
    tmp, _ = workdir
    cmd = [str(ACCELERATE), "launch", "--num_processes", "2", "--main_process_port",
           str(free_port()), str(tmp / "train.py"), *_script_args(tmp, tmp / "single")]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp, capture_output=True, text=True, timeout=200)
    assert proc.returncode != 0
    assert "accelerate launch was asked for 2 processes but started 1" in proc.stderr
    assert "configs/accelerate-zeroio.yaml" in proc.stderr
    assert not (tmp / "single" / "final").exists()
