"""Checkpoint save / load GB/s of a ~1B-parameter state, beside `zeroio bench io` on the same disk.

A synthetic `ShardedState` (arrays fp32, exp_avg, exp_avg_sq: 12 bytes a
parameter, 12 GB at 1B) is split evenly over --ranks processes (gloo, like
torchrun ranks), each saving its segments concurrently into one checkpoint,
then loading its own range back. Before the load, the chunk files are
evicted from the page cache (posix_fadvise DONTNEED after fsync), so the load
reads the disk, not memory. A second load on --ranks-load ranks measures a
world-size change (reads cross the writers' boundaries).

    python benchmarks/bench_checkpoint.py --path /nvme/zeroio-bench --params 1e9 --ranks 8

Results: benchmarks/results/checkpoint-<host>-<date>.json (machine, date,
commit); a table, or one JSON object with --json.

--export adds the safetensors export (`write_safetensors`, what `zeroio consolidate` and
`zeroio train`'s final export run) of a one-rank fp32 checkpoint of --export-params, beside
a plain sequential read of the same chunk files, both from a cold page cache; --export-only
skips the save/load measurement. Export GB/s counts checkpoint bytes read (fp32), the
output is written without fsync.

    python benchmarks/bench_checkpoint.py --path /nvme/zeroio-bench --export-only --export-params 1e9

--nvme-link measures an engine's save with ``offload_optimizer.device: nvme`` both ways, side by
side in --path: the moments copied through host memory into chunks (``share_swap=False``) and
their swap files shared with the checkpoint (hard links / reflinks, docs/checkpoint.md), for a
model of --link-params parameters after one training step each; seconds and bytes written
against a full copy (``engine.last_save``). Small by default, so it runs on a CPU machine:

    python benchmarks/bench_checkpoint.py --path /tmp --nvme-link --link-params 2e7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import provenance  # noqa: E402  (benchmarks/provenance.py: machine, date, commit)
import torch

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
_BLOCK = 1 << 24


def _bounds(total: int, world: int, rank: int) -> tuple[int, int]:
    return total * rank // world, total * (rank + 1) // world


def _state(total: int, rank: int, world: int, kinds: tuple[str, ...] = KINDS):
    from zeroio.checkpoint import Segment, ShardedState, build_index

    # a Llama-ish list of parameters: 2-D blocks of 4096 columns, the rest in a last 1-D one
    cols = 4096
    rows = total // cols
    per = max(1, rows // 256)
    shapes = [(f"layers.{i}.weight", (min(per, rows - i * per), cols)) for i in range(-(-rows // per))]
    if total - rows * cols:
        shapes.append(("tail.bias", (total - rows * cols,)))
    index = build_index(shapes)
    lo, hi = _bounds(total, world, rank)
    block = torch.randn(_BLOCK)
    arrays = {}
    for k in kinds:
        t = torch.empty(hi - lo)
        for a in range(0, hi - lo, _BLOCK):
            b = min(hi - lo, a + _BLOCK)
            t[a:b] = block[: b - a]
        arrays[k] = [Segment(lo, t)]
    return ShardedState(index=index, arrays=arrays, meta={"stage": 3})


def _evict(tag_dir: str) -> None:
    for dirpath, _dirs, files in os.walk(tag_dir):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rank_save_load(path: str, total: int, chunk_mb: int, threads: int, verify: bool,
                    direct: bool = False) -> dict:
    from zeroio.checkpoint import Comm, SaveOptions, load_sharded, save_sharded

    comm = Comm.default()
    state = _state(total, comm.rank, comm.world_size)
    extra = {"direct": True} if direct else {}  # older SaveOptions lack the field
    opts = SaveOptions(chunk_bytes=chunk_mb << 20, threads=threads, verify=verify, progress=False, **extra)
    comm.all_ok(True)
    t0 = time.perf_counter()
    tdir = save_sharded(state, path, "bench", comm=comm, options=opts)
    save_s = time.perf_counter() - t0
    if comm.rank == 0:
        _evict(str(tdir))
    comm.all_ok(True)
    for segs in state.arrays.values():
        segs[0].tensor.zero_()
    t0 = time.perf_counter()
    load_sharded(path, "bench", state, comm=comm, threads=threads)
    comm.all_ok(True)
    load_s = time.perf_counter() - t0
    return {"save_s": save_s, "load_s": load_s}


def _rank_load(path: str, total: int, threads: int) -> dict:
    from zeroio.checkpoint import Comm, load_sharded

    comm = Comm.default()
    state = _state(total, comm.rank, comm.world_size)
    if comm.rank == 0:
        _evict(os.path.join(path, "bench"))
    comm.all_ok(True)
    t0 = time.perf_counter()
    load_sharded(path, "bench", state, comm=comm, threads=threads)
    comm.all_ok(True)
    return {"load_s": time.perf_counter() - t0}


def _read_files(tag_dir: str, block: int = 16 << 20) -> int:
    """Read every file under ``tag_dir`` front to back on one thread; the bytes read."""
    buf, n = bytearray(block), 0
    view = memoryview(buf)
    for dirpath, _dirs, files in os.walk(tag_dir):
        for f in sorted(files):
            with open(os.path.join(dirpath, f), "rb", buffering=0) as fh:
                while k := fh.readinto(view):
                    n += k
    return n


def _export(path: str, total: int, chunk_mb: int, dtype: str | None) -> dict:
    """Cold-cache raw read of a one-rank fp32 checkpoint, then its safetensors export."""
    from zeroio.checkpoint import SaveOptions, save_sharded, write_safetensors

    root = os.path.join(path, "export-ckpt")
    out = os.path.join(path, "export-out")
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    state = _state(total, 0, 1, kinds=("fp32",))
    tdir = str(save_sharded(state, root, "bench", options=SaveOptions(chunk_bytes=chunk_mb << 20, progress=False)))
    del state
    nbytes = total * 4
    _evict(tdir)
    t0 = time.perf_counter()
    raw_bytes = _read_files(os.path.join(tdir, "fp32"))
    raw_s = time.perf_counter() - t0
    _evict(tdir)
    t0 = time.perf_counter()
    write_safetensors(root, out, "bench", dtype=dtype, progress=False)
    export_s = time.perf_counter() - t0
    out_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return {"params": total, "bytes": nbytes, "chunk_mb": chunk_mb, "dtype": dtype or "fp32",
            "output_bytes": out_bytes,
            "raw_read": {"seconds": raw_s, "gbps": raw_bytes / raw_s / 1e9},
            "export": {"seconds": export_s, "gbps": nbytes / export_s / 1e9}}


def _bench_io(path: str, size: str) -> dict | None:
    cmd = [sys.executable, "-m", "zeroio.cli", "bench", "io", "--path", path, "--size", size, "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError, OSError) as e:
        return {"error": str(e)[:500]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="directory on the disk to measure (e.g. the NVMe mount)")
    ap.add_argument("--params", type=float, default=1e9, help="parameters (12 bytes each on disk)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks that save (and load back)")
    ap.add_argument("--ranks-load", type=int, default=None, help="ranks of a second, resharding load")
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4, help="I/O threads per rank")
    ap.add_argument("--no-verify", action="store_true", help="skip the read-back crc check on save")
    ap.add_argument("--direct", action="store_true",
                    help="SaveOptions.direct: O_DIRECT writes; the verify then reads the device")
    ap.add_argument("--io-size", default="8G", help="--size of the `zeroio bench io` run (0 = skip)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoint on disk")
    ap.add_argument("--export", action="store_true", help="also measure the safetensors export")
    ap.add_argument("--export-only", action="store_true", help="measure the export only (no save/load)")
    ap.add_argument("--export-params", type=float, default=None, help="parameters of the exported "
                    "checkpoint (fp32, 4 bytes each; default --params)")
    ap.add_argument("--export-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="dtype of the exported tensors (default the checkpoint's fp32)")
    ap.add_argument("--nvme-link", action="store_true",
                    help="an NVMe-offloaded engine's save: moments copied vs swap files shared")
    ap.add_argument("--link-params", type=float, default=2e7, help="parameters of --nvme-link's model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    from zeroio.testing import run_ranks

    total = int(args.params)
    root = os.path.join(args.path, "zeroio-bench-checkpoint")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    nbytes = total * 4 * len(KINDS)
    if args.export_only:
        _export_main(args, root)
        return
    if args.nvme_link:
        _link_main(args, root)
        return
    env = {"OMP_NUM_THREADS": "2"}
    res = run_ranks(_rank_save_load, args.ranks, root, total, args.chunk_mb, args.threads,
                    not args.no_verify, args.direct, timeout=3600, threads=2, env=env)
    save_s = max(r["save_s"] for r in res)
    load_s = max(r["load_s"] for r in res)
    result = {
        **provenance.header(args.path),
        "path": args.path, "params": total, "bytes": nbytes, "ranks": args.ranks,
        "chunk_mb": args.chunk_mb, "threads_per_rank": args.threads, "verify": not args.no_verify,
        "direct": args.direct,
        "save": {"seconds": save_s, "gbps": nbytes / save_s / 1e9},
        "load": {"seconds": load_s, "gbps": nbytes / load_s / 1e9},
    }
    if args.ranks_load:
        r2 = run_ranks(_rank_load, args.ranks_load, root, total, args.threads, timeout=3600, threads=2, env=env)
        t = max(r["load_s"] for r in r2)
        result["load_resharded"] = {"ranks": args.ranks_load, "seconds": t, "gbps": nbytes / t / 1e9}
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.io_size != "0":
        result["bench_io"] = _bench_io(args.path, args.io_size)
    if args.export:
        result["export"] = _export(root, int(args.export_params or total), args.chunk_mb, args.export_dtype)
        shutil.rmtree(root, ignore_errors=True)
    out = provenance.write_result(args.out, "checkpoint", result)
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint of {total / 1e9:.2f}B parameters ({nbytes / 1e9:.1f} GB, fp32 + 2 Adam moments) "
          f"on {args.path}, {args.ranks} rank(s) x {args.threads} thread(s)")
    print(f"  {'operation':<24}{'seconds':>10}{'GB/s':>10}")
    save_name = ("save (+verify)" if result["verify"] else "save") + (" direct" if args.direct else "")
    rows = [(save_name, result["save"]),
            (f"load ({args.ranks} ranks)", result["load"])]
    if "load_resharded" in result:
        rows.append((f"load ({args.ranks_load} ranks)", result["load_resharded"]))
    for name, r in rows:
        print(f"  {name:<24}{r['seconds']:>10.2f}{r['gbps']:>10.2f}")
    io = result.get("bench_io") or {}
    for side in ("engine", "raw"):
        if isinstance(io.get(side), dict):
            print(f"  zeroio bench io {side:<8} write {io[side].get('write_gbps', float('nan')):.2f} GB/s"
                  f"  read {io[side].get('read_gbps', float('nan')):.2f} GB/s")
    if "export" in result:
        _print_export(result["export"])
    print(f"wrote {out}")


def _print_export(e: dict) -> None:
    print(f"export of {e['params'] / 1e9:.2f}B fp32 parameters ({e['bytes'] / 1e9:.2f} GB) to "
          f"{e['dtype']} safetensors, {e['chunk_mb']} MB chunks, cold cache")
    print(f"  {'operation':<24}{'seconds':>10}{'GB/s':>10}")
    for name, key in (("plain read (1 thread)", "raw_read"), ("write_safetensors", "export")):
        print(f"  {name:<24}{e[key]['seconds']:>10.2f}{e[key]['gbps']:>10.2f}")


def _export_main(args, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    total = int(args.export_params or args.params)
    result = {**provenance.header(args.path), "path": args.path,
              "export": _export(root, total, args.chunk_mb, args.export_dtype)}
    shutil.rmtree(root, ignore_errors=True)
    out = provenance.write_result(args.out, "export", result)
    if args.json:
        print(json.dumps(result))
        return
    _print_export(result["export"])
    print(f"wrote {out}")


def _rank_link(root: str, params: int) -> dict:
    """One NVMe-offloaded engine; a step before each save, so each has the same dirty state."""
    import zeroio
    from zeroio.checkpoint.engine_io import save_checkpoint
    from zeroio.checkpoint.writer import SaveOptions

    width = 1024
    layers = max(1, params // (width * width + width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {
               "device": "nvme", "nvme_path": os.path.join(root, "swap")},
               # host: masters, gradients and, without a GPU, the parameters (8 or ~16 B/param)
               # + a quarter of the moments; the rest streams, as at 15-20B parameters
               # (resident moments are written once per save: engine.last_save's bytes_flushed)
               "tiering": {"cpu_budget_bytes": params * (10 if torch.cuda.is_available() else 18)
                           + (64 << 20)}}}
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    engine.show_progress = False
    out = {"params": sum(p.numel() for p in model.parameters())}
    for name, share in (("copy", False), ("shared", True), ("shared_again", True)):
        x = torch.randn(2, width).to(engine.device, next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        save_checkpoint(engine, os.path.join(root, "ck"), tag=name,
                        options=SaveOptions(share_swap=share, progress=False, aio=engine.config.aio))
        out[name] = dict(engine.last_save)
    engine.close()
    return out


def _link_main(args, root: str) -> None:
    from zeroio.testing import run_ranks

    (r,) = run_ranks(_rank_link, 1, root, int(args.link_params), timeout=3600, threads=2)
    shutil.rmtree(root, ignore_errors=True)
    result = {**provenance.header(args.path), "path": args.path, "nvme_link": r}
    out = provenance.write_result(args.out, "checkpoint-nvme-link", result)
    if args.json:
        print(json.dumps(result))
        return
    print(f"save of an NVMe-offloaded engine, {r['params'] / 1e6:.1f}M parameters "
          f"(fp32 + 2 Adam moments: {r['copy']['full_copy_bytes'] / 1e6:.1f} MB), on {args.path}")
    print(f"  {'save':<14}{'seconds':>9}{'written MB':>12}{'of a copy':>11}{'linked':>8}{'copied':>8}  fallback")
    for name in ("copy", "shared", "shared_again"):
        s = r[name]
        links = s["files_hardlinked"] + s["files_reflinked"]
        print(f"  {name:<14}{s['seconds']:>9.3f}{s['bytes_written'] / 1e6:>12.1f}"
              f"{s['bytes_written'] / max(1, s['full_copy_bytes']):>10.0%}{links:>8}{s['files_copied']:>8}"
              f"  {s['fallback'] or '-'}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
