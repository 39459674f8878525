"""The config a `zeroio train` run trains with: the built-in one or --config's, the options
that set config keys applied over it, "auto" filled from the options by ``load_config``.

An option that sets a key (--ratio, --timeout, --keep-last) and a --config that sets the
same key to another value contradict each other: a ConfigError naming both, never one
silently winning. Options the user did not type (their defaults) yield to the config.
"""

from __future__ import annotations

from pathlib import Path

from zeroio.cli.train import placement
from zeroio.cli.train.defaults import default_config
from zeroio.errors import ConfigError

SMALL_PRESETS = ("tiny", "small")
DEFAULT_MICRO_BATCH = 4
DEFAULT_GRAD_ACCUM = 1


def read_user_config(config: str) -> dict:
    """The --config file's JSON object (the config layer's reader: UTF-8, no repeated key)."""
    from zeroio.config.loader import read_config

    if not Path(config).is_file():
        why = "is not a file" if Path(config).exists() else "does not exist"
        raise ConfigError(f"--config {config} {why}; pass a DeepSpeed JSON config file",
                          key="config")
    return read_config(config)


def base_config(opts, *, cuda: bool) -> dict:
    """The raw built-in config (its nvme_path --nvme-path or --output/nvme) or --config's."""
    if opts.config is None:
        return default_config(placement.nvme_path(opts), cuda=cuda)
    return read_user_config(opts.config)


def _source(opts) -> str | None:
    return f"--config {opts.config}" if opts.config is not None else None


def _set(raw: dict, path: str, value, flag: str, source: str | None) -> dict:
    """``raw`` with the key at dotted ``path`` set to ``value`` (the option ``flag``); a user
    config (``source``) that sets it to anything else contradicts the option (ConfigError)."""
    *heads, leaf = path.split(".")
    chain = [dict(raw)]  # raw, then each block on the way to the key (copies)
    for i, head in enumerate(heads):
        block = chain[-1].get(head)
        if block is not None and not isinstance(block, dict):
            where = ".".join(heads[:i + 1])
            raise ConfigError(f"{where} in {source} must be a JSON object, got {block!r}",
                              key=where)
        chain.append(dict(block or {}))
    have = chain[-1].get(leaf, "auto")
    if source is not None and have != "auto" and have != value:
        raise ConfigError(f"{flag} {value:g} contradicts {path} = {have!r} in {source}; drop "
                          "one of them", key=path)
    chain[-1][leaf] = value
    for i in reversed(range(len(heads))):
        chain[i][heads[i]] = chain[i + 1]
    return chain[0]


def with_ratio(raw: dict, ratio: float, source: str | None) -> dict:
    """``raw`` with zero_optimization.offload_optimizer.ratio = ``ratio`` (--ratio); the range
    and the stage are checked by load_config like any config's."""
    return _set(raw, "zero_optimization.offload_optimizer.ratio", ratio, "--ratio", source)


def with_timeout(raw: dict, timeout: float, source: str | None) -> dict:
    """``raw`` with distributed.timeout_s = ``timeout`` (--timeout)."""
    return _set(raw, "distributed.timeout_s", timeout, "--timeout", source)


def with_keep_last(raw: dict, keep: int, source: str | None) -> dict:
    """``raw`` with checkpoint.keep_last = ``keep`` (--keep-last)."""
    return _set(raw, "checkpoint.keep_last", keep, "--keep-last", source)


def auto_values(opts, *, cuda: bool) -> dict:
    """The values "auto" keys are filled from: the options, or their defaults."""
    small = (opts.preset if opts.preset is not None else "tiny") in SMALL_PRESETS
    lr = opts.lr if opts.lr is not None else (3e-3 if small and opts.model_config is None
                                              else 3e-4)
    return dict(
        per_device_train_batch_size=(opts.micro_batch if opts.micro_batch is not None
                                     else DEFAULT_MICRO_BATCH),
        gradient_accumulation_steps=(opts.grad_accum if opts.grad_accum is not None
                                     else DEFAULT_GRAD_ACCUM),
        learning_rate=lr, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=1.0, bf16=cuda, fp16=False, num_training_steps=opts.steps,
        warmup_steps=opts.warmup if opts.warmup is not None else max(1, opts.steps // 10),
    )


# option -> the "auto" value it fills: only what the user typed can contradict the config
_TYPED = {"micro_batch": "per_device_train_batch_size", "lr": "learning_rate",
          "grad_accum": "gradient_accumulation_steps", "steps": "num_training_steps",
          "warmup": "warmup_steps"}


def resolve_config(opts, mcfg, *, world_size: int, cuda: bool, out: Path | None = None,
                   zero: dict | None = None):
    """The built-in or user config as a ``Config``, "auto" filled from the options (before the
    process group exists: its timeout is in the config); ``zero``: the planned placement keys
    (placement.py), applied over it. ``out`` is unused (kept for callers)."""
    from zeroio.config import load_config
    from zeroio.integrations.autofill import check_no_contradictions

    raw = base_config(opts, cuda=cuda)
    if zero is not None:
        raw = placement.apply(raw, zero)
    if opts.ratio is not None:
        raw = with_ratio(raw, opts.ratio, _source(opts))
    if opts.timeout is not None:
        raw = with_timeout(raw, opts.timeout, _source(opts))
    if opts.keep_last is not None:
        raw = with_keep_last(raw, opts.keep_last, _source(opts))
    values = auto_values(opts, cuda=cuda)
    check_no_contradictions(raw, "the command line",
                            **{v: values[v] for k, v in _TYPED.items() if k in opts.given})
    return load_config(raw, world_size=world_size, hidden_size=mcfg.hidden_size, **values)
