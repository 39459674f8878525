"""`zeroio tune io`: sweep block size x queue depth x threads; print (and write) the best aio block."""

from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="tuning sweeps: `zeroio tune io`")
    what = p.add_subparsers(dest="tune_what", metavar="WHAT")
    io = what.add_parser("io", help="find the fastest aio block for a directory")
    io.add_argument("--path", required=True, help="directory on the device (e.g. the nvme_path)")
    io.add_argument("--size", default="1G", help="bytes per trial, e.g. 1G (default 1G)")
    io.add_argument("--block-sizes", default="256K,1M,4M", help="comma list (default 256K,1M,4M)")
    io.add_argument("--queue-depths", default="4,8,32", help="comma list (default 4,8,32)")
    io.add_argument("--threads", default="1,2,4,8", help="comma list (default 1,2,4,8)")
    io.add_argument("--write-config", default=None, metavar="FILE",
                    help="write the best block as \"aio\" into FILE (updated in place if it is a JSON config)")
    io.add_argument("--json", action="store_true", help="print one JSON object only")
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def write_aio(path: str, aio: dict) -> None:
    """Put ``aio`` into the JSON config at ``path`` (other keys kept), atomically."""
    from zeroio.config.loader import read_config
    from zeroio.io.files import atomic_write_json

    config = read_config(path) if os.path.exists(path) else {}
    config["aio"] = aio
    atomic_write_json(path, config, indent=2)


def check_args(args) -> dict:
    """Every option of `tune io` checked before the sweep (ConfigError, exit 2, naming the
    flag), --write-config included: a file that cannot take the block fails now, not after
    the sweep. The values ``tune_io`` takes."""
    from zeroio.cli import io_options as opt

    opt.writable_config("--write-config", args.write_config)
    return dict(directory=opt.directory("--path", args.path), size=opt.size("--size", args.size),
                block_sizes=opt.size_list("--block-sizes", args.block_sizes),
                queue_depths=opt.int_list("--queue-depths", args.queue_depths),
                thread_counts=opt.int_list("--threads", args.threads))


def run(args) -> int:
    from zeroio.io.bench import tune_io

    aio, rows = tune_io(**check_args(args), progress=not (args.json or args.quiet))
    if args.write_config:
        write_aio(args.write_config, aio)
    if args.json:
        print(json.dumps({"aio": aio, "trials": rows}))
        return 0
    print(f"{'block_size':>12}{'queue_depth':>12}{'threads':>8}{'write GB/s':>12}{'read GB/s':>12}")
    for r in sorted(rows, key=lambda r: -r["score"]):
        print(f"{r['block_size']:12d}{r['queue_depth']:12d}{r['thread_count']:8d}"
              f"{r['write_gbps']:12.3f}{r['read_gbps']:12.3f}")
    print(json.dumps({"aio": aio}, indent=2))
    if args.write_config:
        print(f"wrote the aio block to {args.write_config}")
    return 0
