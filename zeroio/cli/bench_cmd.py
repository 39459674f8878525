"""`zeroio bench io`: sequential GB/s of the I/O engine beside the raw device."""

from __future__ import annotations

import json


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


def check_args(args) -> dict:
    """Every option of `bench io` checked before anything is written (ConfigError, exit 2,
    naming the flag); the values ``bench_io`` takes."""
    from zeroio.cli import io_options as opt

    return dict(
        directory=opt.directory("--path", args.path),
        size=opt.size("--size", args.size),
        block_size=opt.size("--block-size", args.block_size) if args.block_size else None,
        queue_depth=opt.positive("--queue-depth", args.queue_depth),
        threads=opt.positive("--threads", args.threads),
        aio_cfg=opt.aio_block("--config", args.config),
        fio=opt.executable("--fio", args.fio),
        sustained=opt.size("--sustained", args.sustained) if args.sustained else None,
    )


def run(args) -> int:
    from zeroio.io.bench import bench_io, disk_table

    values = check_args(args)
    result = bench_io(**values, raw=args.raw, progress=not (args.json or args.quiet),
                      sweep=not args.no_sweep)
    if args.json:
        print(json.dumps(result))
        return 0
    print("\n".join(disk_table(result)))
    return 0
