"""Running Hugging Face-style scripts (tests/scripts/) on 2 CPU ranks, with or without the
``deepspeed`` facade, and the tiny local model, tokenizer and corpus they train on.

Nothing is downloaded: the model is a tiny ``LlamaConfig`` saved with
``save_pretrained``, the tokenizer a character-level ``tokenizers`` model built here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from zeroio.deepspeed.facade import shim_dir
from zeroio.testing.multirank import free_port, outside_launcher_env, path_first

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"

CORPUS = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat\n"
    "a small model learns to predict the next letter of a short text again and again\n"
    "zero redundancy optimizers split the training state across the ranks of a job\n"
    "every rank keeps one shard of the parameters and gathers the rest when needed\n"
)


def write_corpus(path: Path, repeats: int = 12) -> Path:
    path.write_text(CORPUS * repeats)
    return path


def char_tokenizer(text: str):
    """A character-level fast tokenizer over ``text`` with pad/eos/unk tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(text) - {"\n"})
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_causal_lm(folder: Path, *, vocab_size: int = 24, seed: int = 0) -> int:
    """A tiny Llama (``vocab_size`` rows, fewer than the tokenizer's: scripts resize) and the
    character tokenizer, saved in ``folder``; returns the tokenizer's length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    model.save_pretrained(folder)
    tok = char_tokenizer(CORPUS)
    tok.save_pretrained(folder)
    return len(tok)


def script_env(*, facade: bool, tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a script run: offline, one thread, the facade first on the path
    when ``facade`` (what ``zeroio launch`` does)."""
    path = [str(shim_dir()), str(REPO)] if facade else [str(REPO)]
    return outside_launcher_env(
        PYTHONPATH=path_first(*path), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "datasets-cache"),
        WANDB_DISABLED="true", ACCELERATE_DISABLE_RICH="1", **extra)


def torchrun(script: str | Path, args: list[str], env: dict[str, str], *, nproc: int = 2,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N script args`` (raises with the output on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(script), *args]
    return _run(cmd, env, timeout)


def zeroio_launch(script: str | Path, args: list[str], env: dict[str, str], *, nproc: int = 2,
                  timeout: float = 300) -> subprocess.CompletedProcess:
    """``zeroio launch --nproc N script args``: the launcher puts the facade first on the
    children's path and passes ``--local_rank`` (give it an ``env`` without the facade)."""
    cmd = [sys.executable, "-m", "zeroio.cli", "launch", "--nproc", str(nproc),
           "--master_port", str(free_port()), str(script), *args]
    return _run(cmd, env, timeout)


def accelerate_launch(config_file: Path, script: str | Path, args: list[str],
                      env: dict[str, str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           "--main_process_port", str(free_port()), str(script), *args]
    return _run(cmd, env, timeout)


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-12000:]}")
    return proc


def train_losses(output_dir: Path) -> list[float]:
    """The logged training losses of a Trainer run (its ``trainer_state.json``)."""
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


def write_preferences(path: Path) -> Path:
    """prompt/chosen/rejected rows from the corpus: the true continuation against a reversed one."""
    rows = []
    for line in CORPUS.splitlines():
        for cut in (8, 16, 24, 32):
            rest = line[cut:cut + 12]
            rows.append({"prompt": line[:cut], "chosen": rest, "rejected": rest[::-1]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
