"""zeroio's environment overrides (``ZEROIO_*``): the one place they are read.

Each override is documented in docs/config.md ("Environment overrides"). Two kinds:

- a *key override* replaces one ``zero_optimization.tiering`` key when the config
  is loaded: ``load_config`` writes the variable's value into the key, so the
  resolved ``Config`` (and ``Config.to_dict()``) holds what training uses, and
  nothing below the config layer looks at the variable again;
- a *process override* selects something that belongs to the process, not to a
  model's config (the CPU Adam kernel, shared by every engine of the process and
  by ``zeroio estimate``; the host step's CPU threads, a property of how the
  launcher bound the ranks to cores; the host memory the ranks may use, a property
  of the machine that initialize's preflight measures; whether the ``deepspeed``
  facade prints its start-up line). Its reader here is what the code below calls.

Every override that is set when a config is loaded is listed in
``Config.to_dict()["env_overrides"]`` (variable -> ``{"value", "key"}``; key
None for a process override).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zeroio.errors import ConfigError

CPU_ADAM_MODES = ("auto", "compiled", "torch")


def _overlap(raw: str, name: str) -> bool | None:
    low = raw.lower()
    if low == "auto":
        return None
    return low in ("1", "true", "yes")  # anything else off, as documented


def _assist(raw: str, name: str) -> bool | None:
    low = raw.lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    if low == "auto":
        return None
    raise ConfigError(f"{name}={raw!r}: expected 1, 0 or auto (unset it to use "
                      "zero_optimization.tiering.step_assist)", key=name)


def _positive(what: str, example: str) -> Callable[[str, str], int]:
    def parse(raw: str, name: str) -> int:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{name}={raw!r}: expected a positive integer ({what}, e.g. "
                              f"{example}); unset it for the default", key=name)
        return n
    return parse


def _cpu_adam(raw: str, name: str) -> str:
    low = raw.lower()
    if low not in CPU_ADAM_MODES:
        raise ConfigError(f"{name}={low!r}: expected one of {', '.join(CPU_ADAM_MODES)} (auto: "
                          "the compiled one-pass kernel for large host optimizer state)",
                          key=name)
    return low


def _host_memory(raw: str, name: str) -> int | str:
    if raw.lower() == "off":
        return "off"
    try:
        n = float(raw)
    except ValueError:
        n = -1.0
    if not (n >= 0 and n < float("inf") and n.is_integer()):
        raise ConfigError(f"{name}={raw!r}: expected the host memory this node's ranks may use, "
                          "in bytes (e.g. 68719476736 or 64e9), or off to skip the check; unset "
                          "it to measure", key=name)
    return int(n)


def _on_off(raw: str, name: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1 or 0 (unset it for the default)", key=name)


@dataclass(frozen=True)
class Override:
    env: str
    """The environment variable."""
    key: str | None
    """The config key it replaces (a ``zero_optimization.tiering`` key); None: a process
    override, read by ``value``."""
    parse: Callable[[str, str], object]
    """(stripped text, variable name) -> value; ConfigError naming the variable."""


OVERLAP_STEP = Override("ZEROIO_OVERLAP_STEP", "zero_optimization.tiering.overlap_step", _overlap)
STEP_ASSIST = Override("ZEROIO_STEP_ASSIST", "zero_optimization.tiering.step_assist", _assist)
STEP_CHUNK_NUMEL = Override("ZEROIO_STEP_CHUNK_NUMEL", "zero_optimization.tiering.step_chunk_numel",
                            _positive("elements per stage-3 host Adam chunk", "16777216"))
CPU_ADAM = Override("ZEROIO_CPU_ADAM", None, _cpu_adam)
STEP_THREADS = Override("ZEROIO_STEP_THREADS", None,
                        _positive("CPU threads for the host optimizer step", "8"))
HOST_MEMORY = Override("ZEROIO_HOST_MEMORY", None, _host_memory)
BANNER = Override("ZEROIO_BANNER", None, _on_off)
OVERRIDES = (OVERLAP_STEP, STEP_ASSIST, STEP_CHUNK_NUMEL, CPU_ADAM, STEP_THREADS, HOST_MEMORY,
             BANNER)


def _raw(o: Override, environ: Mapping[str, str] | None) -> str:
    return (os.environ if environ is None else environ).get(o.env, "").strip()


def value(o: Override, environ: Mapping[str, str] | None = None) -> object | None:
    """``o``'s parsed value, None when the variable is unset or empty."""
    raw = _raw(o, environ)
    return o.parse(raw, o.env) if raw else None


def cpu_adam_mode(environ: Mapping[str, str] | None = None) -> str:
    """``ZEROIO_CPU_ADAM``: auto (default), compiled or torch."""
    return value(CPU_ADAM, environ) or "auto"


def host_step_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``ZEROIO_STEP_THREADS``: CPU threads of the host step; None = this rank's share."""
    return value(STEP_THREADS, environ)


def host_memory(environ: Mapping[str, str] | None = None) -> int | str | None:
    """``ZEROIO_HOST_MEMORY``: bytes of host memory this node's ranks may use, replacing the
    measurement of initialize's host-memory check (zeroio/preflight.py); "off" skips the
    check; None = measure."""
    return value(HOST_MEMORY, environ)


def banner(environ: Mapping[str, str] | None = None) -> bool:
    """``ZEROIO_BANNER``: 0 silences the start-up line the ``deepspeed`` facade prints on rank 0
    (zeroio/deepspeed/banner.py); unset or 1: printed unless a log level silences it."""
    v = value(BANNER, environ)
    return True if v is None else bool(v)


def apply(raw: dict, environ: Mapping[str, str] | None = None) -> tuple[dict, dict[str, dict]]:
    """``raw`` (a config's JSON object) with each set key override written into its key, and
    what was set: variable -> {"value": parsed value, "key": key path or None}. The input is
    not modified."""
    applied: dict[str, dict] = {}
    for o in OVERRIDES:
        if not _raw(o, environ):
            continue
        v = value(o, environ)
        applied[o.env] = {"value": v, "key": o.key}
        if o.key is None:
            continue
        *path, name = o.key.split(".")
        raw = dict(raw)
        node = raw
        for part in path:
            child = node.get(part)
            if child is not None and not isinstance(child, dict):
                break  # a malformed section: building it names the key path
            node[part] = child = dict(child or {})
            node = child
        else:
            node[name] = "auto" if v is None else v
    return raw, applied


__all__ = ["BANNER", "CPU_ADAM", "CPU_ADAM_MODES", "HOST_MEMORY", "OVERLAP_STEP", "OVERRIDES",
           "Override", "STEP_ASSIST", "STEP_CHUNK_NUMEL", "STEP_THREADS", "apply", "banner",
           "cpu_adam_mode", "host_memory", "host_step_threads", "value"]
