"""``--bind_cores_to_rank``: each local rank pinned to its own share of the host's cores.

DeepSpeed's rule (``deepspeed/utils/numa.py``): the cores are ``--bind_core_list``
(``"0,2-5,7"``: single cores and inclusive ranges, ascending, not overlapping)
or every core of the machine; each of the N local ranks gets
``len(cores) // N`` consecutive ones, rank i the i-th slice; the launcher sets
``OMP_NUM_THREADS`` to that count. DeepSpeed starts each rank under
``numactl -C``; zeroio's rank applies the same slice to itself with
``os.sched_setaffinity`` before the script runs (zeroio/cli/rank.py), which
needs no numactl and keeps one code path on every Linux host. DeepSpeed also
binds memory to the cores' NUMA node; zeroio leaves memory placement to the
kernel's first-touch default.
"""

from __future__ import annotations

import os

from zeroio.errors import ConfigError


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]`` (DeepSpeed's ``parse_range_list`` rules)."""
    cores: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(f"--bind_core_list {text!r}: {part!r} is not a core or a range "
                              "like 2-5", key="bind_core_list") from None
        if first > last or first < 0:
            raise ConfigError(f"--bind_core_list {text!r}: bad range {part!r}",
                              key="bind_core_list")
        if cores and first <= cores[-1]:
            raise ConfigError(f"--bind_core_list {text!r}: ranges must ascend without "
                              "overlapping", key="bind_core_list")
        cores.extend(range(first, last + 1))
    return cores


def check_on_machine(cores: list[int], text: str) -> list[int]:
    """``cores`` (from --bind_core_list ``text``) when this process may run on every one."""
    allowed = machine_cores()
    missing = sorted(set(cores) - set(allowed))
    if missing:
        raise ConfigError(f"--bind_core_list {text!r}: core(s) {format_core_list(missing)} are not "
                          f"among the cores this process may use ({format_core_list(allowed)})",
                          key="bind_core_list")
    return cores


def machine_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cores_per_rank(cores: list[int], local_ranks: int) -> int:
    """How many cores each of ``local_ranks`` ranks gets; at least one, or a ConfigError."""
    per = len(cores) // max(1, local_ranks)
    if per < 1:
        raise ConfigError(f"--bind_cores_to_rank: {len(cores)} core(s) for {local_ranks} ranks "
                          "per node; every rank needs at least one (give fewer ranks or a longer "
                          "--bind_core_list)", key="bind_core_list")
    return per


def rank_cores(cores: list[int], local_ranks: int, local_rank: int) -> list[int]:
    """The slice of ``cores`` local rank ``local_rank`` of ``local_ranks`` is pinned to."""
    per = cores_per_rank(cores, local_ranks)
    return cores[per * local_rank: per * (local_rank + 1)]


def format_core_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (what ``parse_core_list`` reads back)."""
    parts: list[str] = []
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


__all__ = ["check_on_machine", "cores_per_rank", "format_core_list", "machine_cores",
           "parse_core_list", "rank_cores"]
