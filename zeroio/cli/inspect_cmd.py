"""`zeroio inspect CKPT`: tags, arrays, sizes, the world size and stage that wrote it, validity."""

from __future__ import annotations

import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="list what a checkpoint holds",
                       description="List the tags of a zeroio checkpoint directory (complete or not, "
                                   "and why), and for each complete tag its arrays, sizes, model and writer.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--tag", default=None, help="describe only this tag")
    p.add_argument("--verify", action="store_true", help="read every chunk and check its crc32c")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def describe(root, tag=None, verify=False, progress=False) -> dict:
    from pathlib import Path

    from zeroio.checkpoint.layout import read_latest, read_manifest, scan_tags
    from zeroio.checkpoint.reader import ArrayReader
    from zeroio.errors import CheckpointError

    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    tags = []
    for t in scan_tags(root):
        if tag is not None and t.tag != tag:
            continue
        entry = {"tag": t.tag, "complete": t.complete, "path": str(t.path)}
        if not t.complete:
            entry["problem"] = t.reason
            tags.append(entry)
            continue
        m = read_manifest(t.path / "manifest.json")
        hf = m.meta.get("hf_config") or {}
        entry.update({
            "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix)),
            "world_size": m.world_size,
            "stage": m.meta.get("stage"),
            "model_class": m.meta.get("model_class"),
            "hf_model_type": hf.get("model_type"),
            "parameters": len(m.index),
            "numel": m.numel,
            "global_steps": m.scalars.get("engine", {}).get("global_steps"),
            "client_state_keys": sorted(m.client_state),
            "arrays": {k: {"dtype": str(a.dtype).removeprefix("torch."), "numel": a.numel,
                           "bytes": a.nbytes, "chunks": a.num_chunks} for k, a in m.arrays.items()},
            "bytes": sum(a.nbytes for a in m.arrays.values()),
        })
        if verify:
            reader = ArrayReader(m, progress=progress)
            try:
                for kind in m.arrays:
                    reader.read(kind)
                entry["verified"] = True
            except CheckpointError as e:
                entry["complete"], entry["verified"], entry["problem"] = False, False, str(e)
        tags.append(entry)
    if tag is not None and not tags:
        raise CheckpointError(f"tag {tag!r} not found in {root}")
    return {"checkpoint": str(root), "latest": read_latest(root), "tags": tags}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args) -> int:
    info = describe(args.checkpoint, args.tag, args.verify, progress=not args.json)
    if args.json:
        print(json.dumps(info))
        return 0 if all(t["complete"] for t in info["tags"]) else 1
    print(f"{info['checkpoint']}  (latest: {info['latest'] or '-'})")
    for t in info["tags"]:
        if not t["complete"]:
            print(f"  {t['tag']}: INVALID - {t['problem']}")
            continue
        model = t["hf_model_type"] or t["model_class"]
        print(f"  {t['tag']}: written {t['created']} by {t['world_size']} rank(s) at stage {t['stage']}, "
              f"step {t['global_steps']}; {t['parameters']} parameters ({t['numel']:,} elements) of {model}; "
              f"{_human(t['bytes'])}" + ("; verified" if t.get("verified") else ""))
        for k, a in t["arrays"].items():
            print(f"    {k:<12} {a['dtype']:<9} {a['numel']:>14,} elements  {_human(a['bytes']):>10}  "
                  f"{a['chunks']} chunk(s)")
        if t["client_state_keys"]:
            print(f"    client_state: {', '.join(t['client_state_keys'])}")
    return 0 if all(t["complete"] for t in info["tags"]) else 1
