"""Scale-out: the same contenders on 1, 2, ... N GPUs; per-GPU tokens/s and efficiency.

    # on nvidia-h200-x2 (now), a 1.36B model (train_peers' default shape):
    python benchmarks/scale_out.py --nprocs 1,2 --nvme-dir /tmp/scale-nvme
    # on nvidia-h200-x4 / -x8 (when lent), a 6.7B model, same per-GPU batch:
    python benchmarks/scale_out.py --nprocs 1,2,4,8 --hidden 4096 --layers 32 \
        --intermediate 11008 --heads 32 --micro-batch 4 --nvme-dir /tmp/scale-nvme

For each world size it runs train_peers.py's contenders (default: zeroio
stage 2 + cpu, stage 3 + cpu, stage 3 + nvme) with the same per-GPU micro
batch, then writes one table: tokens/s per GPU, scaling efficiency against
the 1- and 2-GPU runs (per-GPU tokens/s at N / per-GPU tokens/s at 1 or 2),
stall time (the part of the step spent waiting on tier transfers, i.e. not
hidden behind compute), peak GPU and host memory. ``scale-<host>-<stamp>``
.json/.md go to --out with machine, date and commit; each world size's own
train_peers table goes to --out/scale-runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import report  # noqa: E402
import train_peers  # noqa: E402

DEFAULT = "zeroio-z2-cpu,zeroio-z3-cpu,zeroio-z3-nvme"


def efficiency(rows: list[dict]) -> list[dict]:
    """Add ``eff_vs_1`` / ``eff_vs_2``: per-GPU tokens/s over the same contender's at 1 / 2 GPUs.

    ``rows`` are report.Row dicts (``name``, ``world``, ``tokens_per_s``, ``status``); a base
    that did not run leaves the ratio None.
    """
    base: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["status"] == "ok" and r["world"] in (1, 2):
            base[(r["name"], r["world"])] = r["tokens_per_s"] / r["world"]
    out = []
    for r in rows:
        per_gpu = r["tokens_per_s"] / r["world"] if r["status"] == "ok" else None
        eff = {}
        for n in (1, 2):
            b = base.get((r["name"], n))
            eff[f"eff_vs_{n}"] = per_gpu / b if per_gpu is not None and b else None
        out.append({**r, "tokens_per_s_per_gpu": per_gpu, **eff})
    return out


COLUMNS = ("contender", "GPUs", "s/step", "tokens/s", "tokens/s/GPU", "eff vs 1", "eff vs 2",
           "stall s/step", "peak GPU GiB (rank 0)", "peak host RSS GiB (rank 0)", "status")


def table(rows: list[dict]) -> str:
    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(rows, key=lambda r: (r["name"], r["world"])):
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "")
        lines.append("| " + " | ".join([
            r["name"], str(r["world"]), f(r["s_per_step"], ".3f"), f(r["tokens_per_s"], ",.0f"),
            f(r["tokens_per_s_per_gpu"], ",.0f"), f(r["eff_vs_1"], ".2f"),
            f(r["eff_vs_2"], ".2f"), f(r["stall_s_per_step"], ".3f"),
            f(r["peak_gpu_gib"], ".1f"), f(r["peak_host_rss_gib"], ".1f"),
            status.replace("|", "/")]) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_spec_args(ap)
    ap.add_argument("--nprocs", default="1,2", help="world sizes, e.g. 1,2,4,8")
    ap.add_argument("--only", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--nvme-dir", type=Path, default=Path("/tmp/zeroio-scale-nvme"))
    ap.add_argument("--libaio-dir", type=Path)
    ap.add_argument("--disk-bench-size", default="4G")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    worlds = [int(n) for n in args.nprocs.split(",")]
    spec = common.spec_from_args(args)
    runs, rows = [], []
    for i, n in enumerate(worlds):
        extra = ["--libaio-dir", str(args.libaio_dir)] if args.libaio_dir else []
        doc = train_peers.main([
            *spec.to_args(), "--only", args.only, "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--nproc", str(n), "--timeout", str(args.timeout), "--nvme-dir",
            str(args.nvme_dir), "--disk-bench-size", args.disk_bench_size if i == 0 else "0",
            "--out", str(args.out / "scale-runs"), "--json", "--quiet", *extra])
        runs.append(doc)
        rows += doc["rows"]
    rows = efficiency(rows)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"scale-{platform.node()}-{stamp}"
    out = {"kind": "scale_out", "machine": report.machine(args.nvme_dir),
           "provenance": report.provenance(Path(__file__).resolve().parents[1]),
           "run": {"model": vars(spec), "num_params": spec.num_params, "worlds": worlds,
                   "steps": args.steps, "warmup": args.warmup},
           "disk": runs[0].get("disk") if runs else None, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    m, p = out["machine"], out["provenance"]
    text = (f"# scale-out ({p['date']}, commit {p['commit']})\n\n- machine: {m['host']}, "
            f"GPUs: {', '.join(m['gpus']) or 'none'}, {m['cpu_count']} CPUs, "
            f"{m['ram_gib']:.0f} GiB RAM\n- model: {spec.num_params / 1e9:.2f} B params, "
            f"micro batch {spec.micro_batch} x seq {spec.seq} per GPU\n\n" + table(rows) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    print(json.dumps(out, default=str) if args.json else text)
    return out


if __name__ == "__main__":
    main()
