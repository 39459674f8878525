"""The options of `zeroio train` and their one check.

[Note: checked before anything is written] ``check_job`` is where every user mistake of a
run is found: each option's range (a value is refused, never turned into another: no
``or``-default makes 0 a default), the files options name (--config, --model-config through
``check_model_config``, the one check `zeroio estimate` makes too, --data), the checkpoint
--resume continues from, the config with the options applied, and whether the data holds one
step's sequences for the world size and micro batch. It runs in the process that launches the
ranks before the run's folder is locked or anything is written or launched (train_cmd.py), and
again in each rank before the process group, the disk pre-flight and the folders
(deterministic: every rank finds the same). Each mistake is a ConfigError (exit 2, one line
naming the flag or file).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from zeroio.cli.train import placement
from zeroio.cli.train.data import check_volume
from zeroio.cli.train.presets import llama_config
from zeroio.cli.train.run_config import read_user_config, resolve_config
from zeroio.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What the command line asked for; None = the default (or the config's own value)."""

    config: str | None = None
    """DeepSpeed-schema config file; None = the built-in stage-3 NVMe config."""
    preset: str | None = None
    """Model preset name (presets.PRESETS); None with no model_config = tiny."""
    model_config: str | None = None
    """A transformers config.json (or its folder) instead of a preset."""
    data: str | None = None
    """Text file or folder; None = the built-in corpus."""
    steps: int = 200
    """Optimizer steps in total (a resumed run continues up to this number)."""
    stop_after: int | None = None
    """Stop this run after this step (a checkpoint is written; --resume continues)."""
    seq_len: int = 128
    micro_batch: int | None = None
    """Sequences per rank per micro-step; None = the config's value, or 4."""
    grad_accum: int | None = None
    """Micro-steps per optimizer step (gradient_accumulation_steps); None = the config's, or 1."""
    lr: float | None = None
    """Peak learning rate; None = the config's value, or 3e-3 (tiny/small) / 3e-4."""
    warmup: int | None = None
    """Warmup steps; None = 10% of --steps."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_last: int | None = None
    """Keep the newest N complete checkpoints (checkpoint.keep_last); None = the config's, or
    all of them."""
    output: str = "zeroio_run"
    resume: bool = False
    tag: str | None = None
    """With resume: the checkpoint tag to continue from; None = the newest complete one."""
    overwrite: bool = False
    """A fresh run may delete files zeroio did not write in model/, checkpoints/, nvme/."""
    quiet: bool = False
    json: bool = False
    seed: int = 1234
    ratio: float | None = None
    """zero_optimization.offload_optimizer.ratio; None = the config's own (1 in the built-in)."""
    no_checkpoint: bool = False
    """Write no training checkpoint; the final model comes from the live engine."""
    no_checkpoint_on_signal: bool = False
    """On SIGTERM/SIGINT write no checkpoint at the step the run stops after (train_cmd.py)."""
    model_dtype: str = "fp32"
    """dtype of the final from_pretrained model: fp32 (the masters) or bf16."""
    timeout: float | None = None
    """distributed.timeout_s (seconds a collective waits); None = the config's (600 s)."""
    progress_every: int = 0
    """One plain stderr line per N steps on rank 0, also under --json/--quiet (0: none), so a
    driver that reads the JSON on stdout (benchmarks/bench_train.py) still shows life."""
    plan: bool | None = None
    """Plan the placement for this machine (--plan / --no-plan); None: plan when the model
    comes from --model-config without --config, or --machine is given (placement.py)."""
    machine: str | None = None
    """--machine FILE: the machine to plan for instead of measuring this one."""
    nvme_path: str | None = None
    """nvme_path of the built-in or planned config; None = --output/nvme."""
    given: frozenset[str] = frozenset()
    """Names of the options the user typed (only these can contradict a config)."""




#: option -> its least value (None: not given, the default applies)
_AT_LEAST = {"steps": 1, "stop_after": 1, "seq_len": 2, "micro_batch": 1, "grad_accum": 1,
             "warmup": 0, "save_every": 0, "keep_last": 1, "progress_every": 0}
_WHAT = {"save_every": " (0: only at the end)", "progress_every": " (0: no progress lines)",
         "warmup": " (0: no warmup)"}
#: options naming a file, folder or name: never empty
_NAMES = ("config", "preset", "model_config", "data", "output", "tag", "machine", "nvme_path")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_values(opts: TrainOptions) -> None:
    """Each option's own range, named by its flag."""
    for name, least in _AT_LEAST.items():
        value = getattr(opts, name)
        if value is not None and value < least:
            raise ConfigError(f"{_flag(name)} must be >= {least}{_WHAT.get(name, '')}, got "
                              f"{value}", key=name)
    for name in _NAMES:
        value = getattr(opts, name)
        if value is not None and not str(value).strip():
            raise ConfigError(f"{_flag(name)} is empty; give a value or drop the flag", key=name)
    if opts.lr is not None and not (math.isfinite(opts.lr) and opts.lr >= 0):
        raise ConfigError(f"--lr must be a finite number >= 0, got {opts.lr:g}", key="lr")
    if opts.timeout is not None and not (math.isfinite(opts.timeout) and opts.timeout > 0):
        raise ConfigError(f"--timeout must be > 0 seconds, got {opts.timeout:g}", key="timeout")
    if opts.ratio is not None and not (math.isfinite(opts.ratio) and 0 < opts.ratio <= 1):
        raise ConfigError(f"--ratio {opts.ratio:g}: expected a number in (0, 1] (the fraction "
                          "of each rank's optimizer state offloaded)", key="ratio")


def _check_no_checkpoint(opts: TrainOptions) -> None:
    clash = [flag for flag, on in (("--resume", opts.resume),
                                   ("--save-every", opts.save_every),
                                   ("--keep-last", opts.keep_last is not None),
                                   ("--stop-after", opts.stop_after is not None)) if on]
    if opts.no_checkpoint and clash:
        raise ConfigError(f"--no-checkpoint writes no checkpoint, so it cannot be combined with "
                          f"{' or '.join(clash)} (they read or write checkpoints); drop one of "
                          "them", key="no_checkpoint")


def _tags_text(tags) -> str:
    complete = [t.tag for t in tags if t.complete]
    broken = [f"{t.tag} ({t.reason})" for t in tags if not t.complete]
    return (f"complete checkpoints there: {', '.join(complete) or 'none'}"
            + (f"; incomplete: {'; '.join(broken)}" if broken else ""))


def check_resume(opts: TrainOptions) -> None:
    """--resume finds a complete checkpoint under --output/checkpoints (--tag's, when given:
    one folder name); --tag without --resume is a mistake too."""
    from zeroio.checkpoint.tags import scan_tags

    ckpt = Path(opts.output) / "checkpoints"
    if opts.tag is not None and not opts.resume:
        raise ConfigError(f"--tag {opts.tag} names the checkpoint --resume continues from; add "
                          "--resume, or drop --tag", key="tag")
    if not opts.resume:
        return
    if opts.tag is not None and (opts.tag in (".", "..") or "/" in opts.tag
                                 or os.sep in opts.tag):
        raise ConfigError(f"--tag {opts.tag!r} must be the name of one checkpoint folder under "
                          f"{ckpt} (e.g. step100)", key="tag")
    tags = scan_tags(ckpt)
    if opts.tag is None:
        if not any(t.complete for t in tags):
            raise ConfigError(f"--resume: no complete checkpoint under {ckpt} to continue from "
                              f"({_tags_text(tags)}); drop --resume to start a fresh run, or "
                              "pass the --output of the run to continue", key="resume")
        return
    found = next((t for t in tags if t.tag == opts.tag), None)
    if found is not None and found.complete:
        return
    why = "is incomplete" if found is not None else "does not exist"
    raise ConfigError(f"--resume --tag {opts.tag}: {ckpt / opts.tag} {why}; "
                      f"{_tags_text(tags)}. Pass one of those to --tag, or drop --tag for the "
                      "newest", key="tag")


def check_options(opts: TrainOptions):
    """The checks that need no config and no world size ([Note: checked before anything is
    written]); the model config (a ``LlamaConfig``) on success."""
    check_values(opts)
    _check_no_checkpoint(opts)
    # not UTF-8, not JSON, a repeated key: fail before launching
    placement.check_options(opts, read_user_config(opts.config) if opts.config is not None
                            else None)
    if opts.data is not None:
        from zeroio.cli.train.data import text_files

        text_files(opts.data)
    check_resume(opts)
    mcfg = llama_config(opts.preset, opts.model_config)
    if opts.seq_len > mcfg.max_position_embeddings:
        raise ConfigError(f"--seq-len {opts.seq_len} exceeds the model's max_position_embeddings "
                          f"{mcfg.max_position_embeddings}", key="seq_len")
    return mcfg


def _micro_batch_from(opts: TrainOptions) -> str:
    """Where the run's micro batch comes from, for a message."""
    if opts.micro_batch is not None:
        return "--micro-batch"
    if opts.config is not None:
        return f"train_micro_batch_size_per_gpu of --config {opts.config}, or its default"
    return "the default; set it with --micro-batch"


def check_job(opts: TrainOptions, world_size: int, *, cuda: bool, zero: dict | None = None):
    """Every check of [Note: checked before anything is written] for a job of ``world_size``
    ranks; ``zero``: the planned placement keys, when planned. ``(model config, Config)``."""
    mcfg = check_options(opts)
    cfg = resolve_config(opts, mcfg, world_size=world_size, cuda=cuda, zero=zero)
    zo = cfg.zero_optimization
    if opts.no_checkpoint and zo.stage == 3 and not zo.stage3_gather_16bit_weights_on_model_save:
        raise ConfigError(
            "--no-checkpoint writes the model from the live engine, which at stage 3 needs "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save true in --config "
            f"{opts.config}; set it, or drop --no-checkpoint",
            key="zero_optimization.stage3_gather_16bit_weights_on_model_save")
    for name in ("offload_param", "offload_optimizer"):
        block = getattr(zo, name)
        path = Path(block.nvme_path) if block.device.value == "nvme" and block.nvme_path else None
        if path is not None and path.exists() and not path.is_dir():
            flag = "--nvme-path" if opts.nvme_path is not None and opts.config is None else (
                f"zero_optimization.{name}.nvme_path in --config {opts.config}")
            raise ConfigError(f"{flag}: {path} is a file; nvme_path must be a folder (made when "
                              "missing)", key=f"zero_optimization.{name}.nvme_path")
    check_volume(data=opts.data, seq_len=opts.seq_len, world_size=world_size,
                 micro_batch=cfg.train_micro_batch_size_per_gpu,
                 micro_batch_from=_micro_batch_from(opts))
    return mcfg, cfg
