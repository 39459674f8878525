"""Rows, the machine record and the table: one format for train_peers.py and scale_out.py.

A contender's JSON comes in two spellings (train_llama.py reports GiB, the
runners bytes); ``row_from`` reads both into one ``Row``. Tier traffic and
stall time come from zeroio's ``engine.stats()``, which counts since the
engine started: per step they are divided by the engine's step count.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
import provenance as _provenance  # noqa: E402

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    label: str
    status: str
    """launch.Status value: ok | failed | timeout | skipped."""
    reason: str = ""
    world: int = 1
    s_per_step: float | None = None
    tokens_per_s: float | None = None
    peak_gpu_gib: float | None = None
    peak_host_rss_gib: float | None = None
    stall_s_per_step: float | None = None
    gb_moved_per_step: dict[str, float] = dataclasses.field(default_factory=dict)
    """Tier pair ("nvme->cpu", ...) -> GB (1e9) per optimizer step, zeroio only."""
    gb_moved_last_step: dict[str, float] | None = None
    """GB per tier pair in the last step alone (steady state; None: not reported)."""
    wall_seconds: float = 0.0
    breakdown: dict | None = None
    """zeroio's step breakdown of the timed steps (train_llama.py ``timed_breakdown``: ``last``
    record and ``mean``), for benchmarks/plot_breakdown.py; None: not reported."""

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s / self.world


def _gib(result: dict[str, Any], key: str) -> float | None:
    if result.get(f"{key}_gib") is not None:
        return float(result[f"{key}_gib"])
    if result.get(f"{key}_bytes") is not None:
        return float(result[f"{key}_bytes"]) / GIB
    return None


def row_from(*, name: str, label: str, status: str, reason: str = "", world: int = 1,
             result: dict[str, Any] | None = None, wall_seconds: float = 0.0) -> Row:
    if result is None:
        return Row(name=name, label=label, status=status, reason=reason, world=world,
                   wall_seconds=wall_seconds)
    stats = result.get("stats") or {}
    steps = max(1, int(stats.get("global_steps") or len(result.get("step_times")
                                                          or result.get("step_seconds") or [1])))
    moved = {pair: n / steps / 1e9 for pair, n in (stats.get("bytes_moved") or {}).items()}
    last = _last_step_moved(stats)
    stall = stats.get("stall_seconds")
    return Row(
        name=name, label=label, status=status, reason=reason,
        world=int(result.get("world_size", world)),
        s_per_step=float(result["s_per_step"]), tokens_per_s=float(result["tokens_per_s"]),
        peak_gpu_gib=_gib(result, "peak_gpu"), peak_host_rss_gib=_gib(result, "peak_host_rss"),
        stall_s_per_step=None if stall is None else float(stall) / steps,
        gb_moved_per_step=moved, wall_seconds=wall_seconds, breakdown=result.get("breakdown"),
        gb_moved_last_step=None if last is None else {k: n / 1e9 for k, n in last.items()})


def _last_step_moved(stats: dict[str, Any]) -> dict[str, int] | None:
    """Bytes per tier pair of the last step, summed over the stats sources that count steps
    (the tiered stores): the steady state, where the average over all steps also holds the
    first step's one-time loads. None when a source that moved bytes has no last step."""
    sources = stats.get("sources") or {}
    out: dict[str, int] = {}
    for src in sources.values():
        if not src.get("bytes_moved"):
            continue
        last = src.get("last_step")
        if not isinstance(last, dict):
            return None
        for pair, n in (last.get("bytes_moved") or {}).items():
            out[pair] = out.get(pair, 0) + n
    return out if sources else None


def machine(disk_path: Path | None = None) -> dict[str, Any]:
    """What ran it (benchmarks/provenance.py): GPUs, CPUs, RAM, free disk where NVMe state goes."""
    return _provenance.machine(disk_path)


def provenance(repo: Path) -> dict[str, Any]:
    """Date and commit (ZEROIO_COMMIT on the device machine, else git)."""
    del repo  # provenance.py knows its repository
    return {"date": _provenance.now().isoformat(timespec="seconds"),
            "commit": _provenance.commit(), "dirty_tree": bool(_provenance.dirty())}


COLUMNS = ("contender", "world", "s/step", "tokens/s", "tokens/s/GPU", "peak GPU GiB",
           "peak host RSS GiB", "stall s/step", "GB/step by tier pair", "status")


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def cells(row: Row) -> list[str]:
    moved = ", ".join(f"{k} {v:.3g}" for k, v in sorted(row.gb_moved_per_step.items()))
    status = row.status if not row.reason else f"{row.status}: {row.reason}"
    return [row.name, str(row.world), _f(row.s_per_step, ".3f"), _f(row.tokens_per_s, ",.0f"),
            _f(row.tokens_per_s_per_gpu, ",.0f"), _f(row.peak_gpu_gib, ".1f"),
            _f(row.peak_host_rss_gib, ".1f"), _f(row.stall_s_per_step, ".3f"), moved,
            status.replace("|", "/")]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """The table back as dicts keyed by column (for tests and for README updates)."""
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [h.strip() for h in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip().strip("|").split("|")), strict=True))
            for ln in rows[1:]]


def write(out_dir: Path, stem: str, doc: dict[str, Any], title: str) -> tuple[Path, Path]:
    """``<stem>.json`` (everything) and ``<stem>.md`` (header + table) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [Row(**r) for r in doc["rows"]]
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jpath.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    m = doc["machine"]
    head = [f"# {title}", "",
            f"- date: {doc['provenance']['date']}, commit {doc['provenance']['commit']}"
            + (" (uncommitted changes in tree)" if doc["provenance"]["dirty_tree"] else ""),
            f"- machine: {m.get('host')}, GPUs: {', '.join(m.get('gpus') or []) or 'none'}, "
            f"{m.get('cpu_count')} CPUs, {m.get('ram_gib', 0):.0f} GiB RAM"
            + (f", {m['disk_free_gib']:.0f} GiB free disk" if "disk_free_gib" in m else ""),
            f"- run: {doc['run']}", ""]
    mpath.write_text("\n".join(head) + markdown_table(rows) + "\n")
    return jpath, mpath
