"""Which hosts and GPU slots a `zeroio launch` uses: DeepSpeed's hostfile and
``--include`` / ``--exclude`` syntax, read the way DeepSpeed's runner reads them.

- hostfile: one ``HOST slots=N`` per line; ``#`` comments and blank lines are
  skipped; a host listed twice or a line of another shape is an error.
- ``--include`` / ``--exclude``: ``NODE_SPEC[@NODE_SPEC ...]``, where
  ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``; a name alone means all its slots.
  ``--include worker-0@worker-1:0,2`` uses every slot of worker-0 and slots 0
  and 2 of worker-1; ``--exclude worker-1:0`` everything but slot 0 of
  worker-1. The two are mutually exclusive, as in DeepSpeed.

The result is an ordered ``{host: [slot, ...]}``, hostfile order kept (it is the
order of node ranks). Without a hostfile the pool is this machine alone,
``localhost``, with its GPUs as slots (or the slots named, on a machine without
CUDA, where a slot is just a process). Every problem is a ``ConfigError``
naming the flag and the host or slot.
"""

from __future__ import annotations

import re
from pathlib import Path

from zeroio.errors import ConfigError

Pool = dict[str, list[int]]

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` of a hostfile's text, in its order."""
    hosts: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ConfigError(f"{source} line {n}: {line!r} is not 'HOST slots=N' (e.g. "
                              "'worker-0 slots=8')", key="hostfile")
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            raise ConfigError(f"{source} line {n}: host {host} is listed twice", key="hostfile")
        hosts[host] = slots
    if not hosts:
        raise ConfigError(f"{source} lists no host ('HOST slots=N' lines)", key="hostfile")
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    """``parse_hostfile`` of the file at ``path``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--hostfile {p}: cannot read it ({e.strerror or e})",
                          key="hostfile") from None
    return parse_hostfile(text, f"hostfile {p}")


def parse_node_specs(spec: str, flag: str) -> dict[str, list[int]]:
    """``NAME[:SLOT,...]@...`` -> ``{host: sorted slots}`` (an empty list: all of its slots)."""
    out: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, sep, slots = part.partition(":")
        if not name:
            raise ConfigError(f"{flag} {spec!r}: empty host name (expected "
                              "NAME[:SLOT[,SLOT...]][@NAME...])", key=flag.lstrip("-"))
        try:
            ids = [int(s) for s in slots.split(",")] if sep else []
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: slots of {name} must be integers, e.g. "
                              f"{name}:0,1", key=flag.lstrip("-")) from None
        out[name] = sorted(set(out.get(name, []) + ids))
    return out


def filter_pool(pool: Pool, include: str = "", exclude: str = "") -> Pool:
    """``pool`` restricted by DeepSpeed's ``--include`` or ``--exclude``; hosts left with no
    slot are dropped, the pool's host order is kept."""
    if include and exclude:
        raise ConfigError("--include and --exclude are mutually exclusive (as in DeepSpeed)",
                          key="include")
    if not include and not exclude:
        return {h: list(s) for h, s in pool.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen = parse_node_specs(spec, flag)
    for host, slots in chosen.items():
        if host not in pool:
            raise ConfigError(f"{flag}: host {host!r} is not in the pool ({', '.join(pool)})",
                              key=flag.lstrip("-"))
        bad = [s for s in slots if s not in pool[host]]
        if bad:
            raise ConfigError(f"{flag}: host {host} has no slot {bad[0]} (its slots: "
                              f"{pool[host]})", key=flag.lstrip("-"))
    if include:
        out = {h: (chosen[h] or list(pool[h])) for h in pool if h in chosen}
    else:
        out = {h: [s for s in pool[h] if chosen.get(h) and s not in chosen[h]]
               if h in chosen else list(pool[h]) for h in pool}
    return {h: s for h, s in out.items() if s}


def local_pool(gpus: int, include: str = "") -> Pool:
    """The pool of a launch without a hostfile: ``localhost`` with ``gpus`` slots; on a
    machine without CUDA (``gpus`` 0) the slots ``--include localhost:...`` names (each one
    process), else one."""
    if gpus > 0:
        return {"localhost": list(range(gpus))}
    named = parse_node_specs(include, "--include").get("localhost") if include else None
    return {"localhost": named or [0]}


__all__ = ["Pool", "filter_pool", "local_pool", "parse_hostfile", "parse_node_specs",
           "read_hostfile"]
