"""`zeroio consolidate CKPT OUT`: a checkpoint as a safetensors folder `from_pretrained` loads."""

from __future__ import annotations

import json
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit ({', '.join(_UNITS)})")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def add_parser(sub) -> None:
    p = sub.add_parser("consolidate", help="write a checkpoint as a safetensors folder",
                       description="Write the weights of a zeroio checkpoint as a safetensors folder "
                                   "(sharded with model.safetensors.index.json when large); a Hugging "
                                   "Face model's config.json is written too, so from_pretrained(OUT) loads it.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (holds `latest` and tag folders)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--tag", default=None, help="tag to export (default: the one `latest` names)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="dtype of the written weights (default: as stored, fp32)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="largest safetensors file before sharding (default 5GB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object (files written)")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """The command line's mistakes, before anything is read or written (ConfigError, exit 2,
    naming the flag or path); what the checkpoint holds is the checkpoint layer's to judge."""
    from pathlib import Path

    from zeroio.checkpoint.tags import check_tag, scan_tags
    from zeroio.errors import CheckpointError, ConfigError

    if args.max_shard_size < 1:
        raise ConfigError(f"--max-shard-size is {args.max_shard_size} bytes; it must be at least 1 "
                          "(e.g. 5GB, 500MiB)", key="max_shard_size")
    ckpt, out = Path(args.checkpoint), Path(args.out)
    if not ckpt.is_dir():
        why = "does not exist" if not ckpt.exists() else "is not a folder"
        raise ConfigError(f"CKPT {ckpt} {why}; pass the checkpoint directory (the folder holding "
                          "`latest` and the tag folders)", key="checkpoint")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {out} exists and is not a folder; pass a folder", key="out")
    if args.tag is not None:
        try:
            check_tag(args.tag)
        except CheckpointError as e:
            raise ConfigError(f"--tag: {e}", key="tag") from None
    if args.tag is not None and not (ckpt / args.tag).is_dir() and not any(
            t.tag == args.tag for t in scan_tags(ckpt)):
        have = [t.tag for t in scan_tags(ckpt) if t.complete]
        raise ConfigError(f"--tag {args.tag}: no such tag in {ckpt}; complete tags there: "
                          f"{', '.join(have) or 'none'}", key="tag")


def run(args) -> int:
    from zeroio.checkpoint.consolidate import write_safetensors

    check_args(args)

    files = write_safetensors(args.checkpoint, args.out, args.tag, dtype=args.dtype,
                              max_shard_bytes=args.max_shard_size,
                              progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps({"out": str(args.out), "files": [f.name for f in files]}))
    elif not args.quiet:
        print(f"wrote {len(files)} file(s) to {args.out}: {', '.join(f.name for f in files)}")
    return 0
