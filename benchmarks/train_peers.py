"""Side-by-side: plain PyTorch, zeroio, DeepSpeed and FSDP2 on one model, one table.

    # the H200 run (1 GPU; DeepSpeed from the carried wheel, libaio unpacked in a folder)
    python benchmarks/train_peers.py --nvme-dir /tmp/peers-nvme --libaio-dir /tmp/libaio
    # two GPUs: every data-parallel contender under torch.distributed.run
    python benchmarks/train_peers.py --nproc 2 --nvme-dir /tmp/peers-nvme --libaio-dir /tmp/libaio
    # a subset, a small model on the CPU
    python benchmarks/train_peers.py --only plain,zeroio-z2-cpu,fsdp2-cpu --hidden 64 \
        --layers 2 --intermediate 128 --heads 4 --vocab 256 --seq 32 --micro-batch 2 \
        --steps 4 --warmup 1 --disk-bench-size 0

Each contender runs as its own process (so peak memory is its own and a
crash is only its row) on the same model (train_llama.py's builder, seed 0)
and the same tokens; see peers/contenders.py for the list and commands.
Prints one table (s/step median after --warmup, tokens/s, peak GPU, peak host
RSS, zeroio's stall time and GB moved per tier pair per step) and writes
``peers-<host>-<stamp>.json`` / ``.md`` with machine, date and commit to
--out (benchmarks/results). A contender that fails or runs past --timeout
gets a row saying how; the table prints regardless. zeroio rows carry their
step breakdown (train_llama.py); with matplotlib importable, one
``<stem>-breakdown-<row>.png`` per such row is written beside the JSON
(benchmarks/plot_breakdown.py).

When an NVMe contender is selected, the disk under --nvme-dir is measured
first with ``zeroio bench io`` (raw read/write GB/s), so NVMe rows can be
set against bytes-through-the-disk / raw bandwidth in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import common  # noqa: E402
import contenders as C  # noqa: E402
import launch  # noqa: E402
import report  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_spec_args(ap)
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(C.BY_NAME)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) per contender")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per contender")
    ap.add_argument("--nvme-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "zeroio-peers-nvme",
                    help="folder on the NVMe disk; each NVMe contender swaps in its own subfolder")
    ap.add_argument("--libaio-dir", type=Path,
                    help="libaio unpacked with dpkg -x (sets CFLAGS, LDFLAGS, CPATH, "
                         "LIBRARY_PATH, LD_LIBRARY_PATH for DeepSpeed)")
    ap.add_argument("--ds-cuda-arch", default="9.0",
                    help="TORCH_CUDA_ARCH_LIST for DeepSpeed's JIT ops when unset (9.0a breaks)")
    ap.add_argument("--disk-bench-size", default="4G",
                    help="bytes for the raw disk measurement before NVMe contenders; 0 = skip")
    ap.add_argument("--set", action="append", default=[], metavar="KEY.PATH=JSON",
                    help="set a key in every contender's config (zeroio and DeepSpeed read the "
                         "same file), e.g. zero_optimization.tiering.overlap_step=true or "
                         "zero_optimization.offload_optimizer.ratio=0.5; repeatable")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    try:
        args.overrides = tuple((k, json.loads(v)) for k, _, v in
                               (item.partition("=") for item in args.set))
    except json.JSONDecodeError as e:
        ap.error(f"--set expects KEY.PATH=JSON: {e}")
    if args.nproc < 1:
        ap.error("--nproc must be >= 1")
    return args


def disk_bench(plan: C.RunPlan, size: str, timeout: float) -> dict | None:
    """``zeroio bench io --json`` under --nvme-dir: raw and engine read/write GB/s."""
    if size in ("0", ""):
        return None
    path = plan.nvme_dir / "disk-bench"
    path.mkdir(parents=True, exist_ok=True)
    argv = [plan.python, "-m", "zeroio.cli", "bench", "io", "--path", str(path), "--size", size,
            "--json", "--quiet"]
    out = launch.run(argv, env=dict(__import__("os").environ), timeout=timeout,
                     log_dir=plan.run_dir / "logs", name="disk-bench")
    shutil.rmtree(path, ignore_errors=True)
    if out.status is not launch.Status.OK:
        return {"error": out.reason}
    return out.result


def disk_bound(row: report.Row, disk: dict | None) -> float | None:
    """Seconds per step the disk needs for this row's NVMe traffic at the raw bandwidth (the
    bytes are one rank's; every rank of the row swaps as much through the same disk)."""
    raw = (disk or {}).get("raw") or {}
    rd, wr = raw.get("read_gbps"), raw.get("write_gbps")
    if not rd or not wr:
        return None
    # steady state: the last step's bytes (the average also holds step 1's one-time loads)
    moved = row.gb_moved_last_step if row.gb_moved_last_step is not None else row.gb_moved_per_step
    read = sum(v for k, v in moved.items() if k.startswith("nvme->"))
    write = sum(v for k, v in moved.items() if k.endswith("->nvme"))
    return row.world * (read / rd + write / wr)


def run_one(c: C.Contender, plan: C.RunPlan, timeout: float) -> report.Row:
    world = C.world_of(c, plan)
    why = C.skip_reason(c, plan)
    if why is not None:
        return report.row_from(name=c.name, label=c.label, status=launch.Status.SKIPPED.value,
                               reason=why, world=world)
    nvme = C.nvme_folder(c, plan) if c.setup is not None and c.setup.on_nvme else None
    if nvme is not None:
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
    argv, env = C.command(c, plan)
    # a contender still running near the deadline prints every thread's stack (train_llama)
    env.setdefault("ZEROIO_TRACEBACK_AFTER_S", str(max(5.0, timeout - 8)))
    try:
        out = launch.run(argv, env=env, timeout=timeout, log_dir=plan.run_dir / "logs",
                         name=c.name, cwd=str(C.REPO))
    finally:
        if nvme is not None:
            shutil.rmtree(nvme, ignore_errors=True)  # the next contender needs the disk
    return report.row_from(name=c.name, label=c.label, status=out.status.value,
                           reason=out.reason, world=world, result=out.result,
                           wall_seconds=out.wall_seconds)


def breakdown_plots(doc: dict, json_path: Path) -> list[str]:
    """benchmarks/plot_breakdown.py's PNG per zeroio row, beside the results JSON, when
    matplotlib is importable (else none: the rows keep their breakdown for later)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return []
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import plot_breakdown

    json_path.parent.mkdir(parents=True, exist_ok=True)
    return [str(p) for p in plot_breakdown.plot(doc, json_path)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    spec = common.spec_from_args(args)
    chosen = C.select(args.only)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = f"peers-{platform.node()}-n{args.nproc}-{stamp}"
    plan = C.RunPlan(spec=spec, steps=args.steps, warmup=args.warmup, nproc=args.nproc,
                     run_dir=args.out / stem, nvme_dir=args.nvme_dir,
                     libaio_dir=args.libaio_dir, ds_cuda_arch=args.ds_cuda_arch,
                     overrides=args.overrides)
    disk = None
    if any(c.setup is not None and c.setup.on_nvme for c in chosen):
        disk = disk_bench(plan, args.disk_bench_size, args.timeout)
    rows = []
    bar = None
    if not (args.quiet or args.json):
        from tqdm import tqdm

        bar = tqdm(chosen, desc="contenders", unit="run")
    for c in chosen:
        if bar is not None:
            bar.set_postfix_str(c.name)
        rows.append(run_one(c, plan, args.timeout))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    bounds = {r.name: b for r in rows
              if (r.gb_moved_last_step or r.gb_moved_per_step)
              and (b := disk_bound(r, disk)) is not None}
    doc = {
        "kind": "train_peers",
        "machine": report.machine(args.nvme_dir),
        "provenance": report.provenance(C.REPO),
        "run": {"model": {**vars(spec)}, "num_params": spec.num_params, "steps": args.steps,
                "warmup": args.warmup, "nproc": args.nproc, "set": args.set,
                "omp_num_threads": C.omp_threads(args.nproc),
                "tokens_per_step_per_rank": spec.tokens_per_step(1)},
        "disk": disk,
        "rows": [vars(r) | {} for r in rows],
        "disk_bound_s_per_step": bounds,
        # the NVMe target: s/step within 1.25x of the disk-bound seconds
        "disk_bound_ratio": {name: r.s_per_step / b for r in rows
                             for name, b in bounds.items() if r.name == name and b > 0
                             and r.s_per_step is not None},
        "labels": {c.name: c.label for c in chosen},
    }
    doc["breakdown_plots"] = breakdown_plots(doc, args.out / f"{stem}.json")
    jpath, mpath = report.write(args.out, stem, doc, "zeroio vs DeepSpeed, FSDP2, plain PyTorch")
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        print(report.markdown_table(rows))
        print(f"wrote {jpath} and {mpath}")
    return doc


if __name__ == "__main__":
    main()
