"""`zeroio bench io`: sequential GB/s of the I/O engine beside the raw device."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: `zeroio bench io`")
    what = p.add_subparsers(dest="bench_what", metavar="WHAT")
    io = what.add_parser("io", help="engine read/write GB/s beside the raw device (dd or fio)")
    io.add_argument("--path", required=True, help="directory on the device to test (e.g. the nvme_path)")
    io.add_argument("--size", default="4G", help="bytes to write and read, e.g. 4G, 512M (default 4G)")
    io.add_argument("--block-size", default=None, help="aio.block_size, e.g. 1M (default 1M)")
    io.add_argument("--queue-depth", type=int, default=None, help="aio.queue_depth (default 8)")
    io.add_argument("--threads", type=int, default=None, help="aio.intra_op_parallelism (default 1)")
    io.add_argument("--config", default=None, help="take the aio block from this DeepSpeed JSON config")
    io.add_argument("--raw", choices=["auto", "dd", "fio", "none"], default="auto",
                    help="raw device tool (auto: fio when installed, else dd)")
    io.add_argument("--fio", default=None, metavar="PATH",
                    help="the fio binary (default: fio on PATH); implies --raw fio under auto")
    io.add_argument("--no-sweep", action="store_true",
                    help="fio: one run at the engine's block size and queue depth instead of "
                    "the best over queue depths 1-32 x 1-4 jobs")
    io.add_argument("--sustained", default=None, metavar="SIZE",
                    help="fio: also one write, read and mixed run over a SIZE file with no time "
                    "limit at the sweep's best settings (a disk's burst rate can be far above "
                    "what it sustains), e.g. 24G")
    io.add_argument("--json", action="store_true", help="print one JSON object only")
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _aio_from_config(path: str | None) -> object | None:
    if path is None:
        return None
    return json.loads(Path(path).read_text(encoding="utf-8")).get("aio") or None


def run(args) -> int:
    if getattr(args, "bench_what", None) != "io":
        raise SystemExit("usage: zeroio bench io --path DIR --size S [--json]")
    from zeroio.io.bench import bench_io, disk_table, parse_size

    result = bench_io(
        args.path,
        parse_size(args.size),
        block_size=parse_size(args.block_size) if args.block_size else None,
        queue_depth=args.queue_depth,
        threads=args.threads,
        raw=args.raw,
        progress=not (args.json or args.quiet),
        aio_cfg=_aio_from_config(args.config),
        fio=args.fio,
        sweep=not args.no_sweep,
        sustained=parse_size(args.sustained) if args.sustained else None,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print("\n".join(disk_table(result)))
    return 0
