"""`zeroio train` on a GPU machine: a Llama preset with ZeRO stage 3 + NVMe offload, on 1 and N GPUs.

    python benchmarks/bench_train.py --preset 1b --nprocs 1 2 --steps 20 --seq-len 512 \\
        --micro-batch 4 --output /tmp/zeroio-bench-train

Runs the built-in default config (stage 3, offload_param + offload_optimizer to NVMe
under OUTPUT/<n>gpu/nvme, bf16 on GPU) through the real command
(`python -m zeroio.cli.main train ... --json`), once per process count, and writes
benchmarks/results/train-<preset>-<host>-<utc date>.json (machine, date, commit,
and per run the command's whole JSON summary: tokens/s overall and without the
first two steps, per-step seconds, first/last loss, swap bytes per tier, rank 0's
peak GPU memory). Prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from procs import kill_group  # noqa: E402
from provenance import commit, machine  # noqa: E402


def run_one(args, nproc: int) -> dict:
    out = os.path.join(args.output, f"{nproc}gpu")
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", "--preset", args.preset,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--nproc", str(nproc), "--output", out,
           "--json", "--progress-every", str(args.progress_every)]
    if args.config:
        cmd += ["--config", args.config]
    env = dict(os.environ)
    print(f"[bench_train] {nproc} GPU(s): {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # stderr inherited: progress and errors stream live; stdout holds the JSON summary
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return {"nproc": nproc, "ok": False, "returncode": None, "command": " ".join(cmd),
                "error": f"timed out after {args.timeout:.0f} s",
                "command_wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    summary = _last_json(stdout)
    if proc.returncode != 0 or summary is None:
        return {"nproc": nproc, "ok": False, "returncode": proc.returncode,
                "command": " ".join(cmd), "stdout_tail": stdout[-3000:],
                "error": f"exit code {proc.returncode}" + ("" if summary else ", no JSON summary"),
                "command_wall_s": wall}
    return {"nproc": nproc, "ok": True, "command_wall_s": wall, "command": " ".join(cmd),
            **summary}


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--config", default=None, help="a config instead of the built-in default")
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--output", default="/tmp/zeroio-bench-train",
                   help="run folders (nvme swap, checkpoints, model)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"),
                   help="folder for the result JSON (default benchmarks/results)")
    p.add_argument("--progress-every", type=int, default=1, metavar="N",
                   help="a progress line on stderr every N steps (0 = none)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default none)")
    args = p.parse_args(argv)

    runs = [run_one(args, n) for n in args.nprocs]
    now = dt.datetime.now(dt.timezone.utc)
    record = {"benchmark": "zeroio train", "preset": args.preset, "date": now.isoformat(),
              "commit": commit(), "machine": machine(), "settings": vars(args), "runs": runs}
    results = args.out
    os.makedirs(results, exist_ok=True)
    path = os.path.join(results, f"train-{args.preset}-{record['machine']['host']}-"
                                 f"{now.strftime('%Y%m%dT%H%M%SZ')}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)

    print(f"{'gpus':>4} {'ok':>3} {'tokens/s':>10} {'steady':>10} {'loss first':>10} "
          f"{'loss last':>10} {'train s':>8} {'peak GPU GB':>11} {'nvme->cpu GB':>12} "
          f"{'cpu->nvme GB':>12}")
    for r in runs:
        if not r["ok"]:
            print(f"{r['nproc']:>4} {'no':>3}  ({r['error']})")
            continue
        moved = r.get("bytes_moved", {})
        print(f"{r['nproc']:>4} {'yes':>3} {r['tokens_per_s'] or 0:>10,.0f} "
              f"{r['steady_tokens_per_s'] or 0:>10,.0f} "
              f"{r['first_loss']:>10.3f} {r['last_loss']:>10.3f} {r['wall_s']:>8.1f} "
              f"{(r['peak_gpu_bytes'] or 0) / 1e9:>11.2f} "
              f"{moved.get('nvme->cpu', 0) / 1e9:>12.2f} {moved.get('cpu->nvme', 0) / 1e9:>12.2f}")
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
