"""Masters paged through NVMe beside the all-resident run: the checks, from one call's runs.

    python benchmarks/masters_nvme_check.py --resident R.json --paged P.json \
        [--disk bench-io.json] --out DIR

``R.json`` and ``P.json`` are benchmarks/train_llama.py results of the same model, seed and
batches with ``offload_optimizer`` nvme: the resident run with a host budget that holds every
master and moment, the paged run with ``offload_optimizer.masters`` paging them under a
smaller ``tiering.cpu_budget_bytes`` ([Note: where the masters live] in
zeroio/optim/swap.py). ``bench-io.json`` is ``zeroio bench io --json`` of the same call: the
disk's rates, which a disk-bound step is reported against.

The checks, one row each:

- ``paged``: the paged run's swap pieces hold the masters (``swap_plan.kinds``);
- ``losses``: the paged run's losses equal the resident run's, bit for bit (paging changes
  where the fp32 values live, not the arithmetic);
- ``host_rss``: the paged run's peak host RSS <= its ``tiering.cpu_budget_bytes`` + 2 GiB;
- ``disk_bytes``: each timed step's optimizer reads and writes <= 1.1 x the bytes the swap
  plan streams each way (``engine.stats()["sources"]["optimizer"]["swap_plan"]``).

Also both runs' s/step and, with the disk's rates, the paged step's disk floor (streamed
bytes at the read rate plus at the write rate). Writes ``masters-nvme.json`` and
``README.md`` (the table) into ``--out``; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GIB = 2**30
RSS_SLACK = 2 * GIB
DISK_SLACK = 1.1


def _load(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _plan(run: dict) -> dict:
    plan = (((run.get("stats") or {}).get("sources") or {}).get("optimizer") or {}).get(
        "swap_plan")
    if not plan:
        raise SystemExit(f"{run.get('config')}: no sources.optimizer.swap_plan in its stats: "
                         "run train_llama.py with offload_optimizer nvme")
    return plan


def _disk_rates(bench: dict | None) -> tuple[float, float] | None:
    """(read, write) bytes/s of the raw disk: the sustained run where there is one."""
    raw = (bench or {}).get("raw") or {}
    best = raw.get("sustained") or raw
    read, write = best.get("read_gbps"), best.get("write_gbps")
    return (read * 1e9, write * 1e9) if read and write else None


def check(resident: dict, paged: dict, bench: dict | None = None) -> dict:
    """Every check's row and the figures beside them (module doc)."""
    plan = _plan(paged)
    budget = ((paged["stats"].get("placement") or {}).get("budgets") or {}).get("cpu")
    streamed = plan["streamed_bytes_each_way"]
    timed = [io for io in paged["optimizer_io"][paged["warmup"]:] if io] or \
        [io for io in paged["optimizer_io"] if io]
    worst = max((max(io["read_bytes"], io["write_bytes"]) for io in timed), default=0)
    rss = paged["peak_host_rss_gib"] * GIB
    rows = {
        "paged": {"ok": "master" in plan["kinds"], "kinds": plan["kinds"]},
        "losses": {"ok": paged["losses"] == resident["losses"],
                   "paged": paged["losses"], "resident": resident["losses"]},
        "host_rss": {"ok": budget is not None and rss <= budget + RSS_SLACK,
                     "peak_bytes": int(rss), "limit_bytes": None if budget is None
                     else budget + RSS_SLACK},
        "disk_bytes": {"ok": bool(timed) and worst <= DISK_SLACK * streamed,
                       "worst_step_bytes": worst, "limit_bytes": int(DISK_SLACK * streamed),
                       "streamed_bytes_each_way": streamed},
    }
    rates = _disk_rates(bench)
    floor = None if rates is None else streamed / rates[0] + streamed / rates[1]
    return {"checks": rows, "ok": all(r["ok"] for r in rows.values()),
            "s_per_step": {"resident": resident["s_per_step"], "paged": paged["s_per_step"]},
            "disk_read_write_bps": rates, "paged_disk_floor_s": floor,
            "params": paged.get("params"), "machine": paged.get("machine"),
            "gpu": paged.get("gpu"), "date": paged.get("date"), "commit": paged.get("commit")}


def table(result: dict) -> str:
    """The README's table: one row per check, then the speeds."""
    lines = ["| check | result | figures |", "|---|---|---|"]
    for name, row in result["checks"].items():
        figures = ", ".join(f"{k} {v}" for k, v in row.items()
                            if k not in ("ok", "paged", "resident"))
        lines.append(f"| {name} | {'pass' if row['ok'] else 'FAIL'} | {figures} |")
    s, floor = result["s_per_step"], result["paged_disk_floor_s"]
    floor_text = "no disk rate measured" if floor is None else f"paged disk floor {floor:.3f} s"
    lines.append(f"| s/step | resident {s['resident']:.3f}, paged {s['paged']:.3f} | "
                 f"{floor_text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resident", required=True, help="train_llama.py JSON of the resident run")
    ap.add_argument("--paged", required=True, help="train_llama.py JSON of the paged run")
    ap.add_argument("--disk", help="zeroio bench io --json of the same call")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    result = check(_load(a.resident), _load(a.paged), _load(a.disk) if a.disk else None)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "masters-nvme.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    text = table(result)
    with open(os.path.join(a.out, "README.md"), "w") as fh:
        fh.write(f"# Masters on NVMe beside the resident run ({result['machine']}, "
                 f"{result['date']}, commit {result['commit']})\n\n{text}")
    print(text, end="")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
