"""`zeroio inspect CKPT`: tags, arrays, sizes, the world size and stage that wrote it, validity.

Exit status: 0 when every listed tag is complete (and verified, with --verify) and `latest`
names one of them; 1 otherwise, and when CKPT is no checkpoint directory (a folder holding
none, or one tag's folder: the error says what to pass instead).
"""

from __future__ import annotations

import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="list what a checkpoint holds",
                       description="List the tags of a zeroio checkpoint directory (complete or not, "
                                   "and why), and for each complete tag its arrays, sizes, model and writer.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("--tag", default=None, help="describe only this tag")
    p.add_argument("--verify", action="store_true",
                   help="read every chunk and check its crc32c (chunk by chunk: a few chunks in memory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _array_problem(m, kind: str) -> str | None:
    """What is wrong with array ``kind``'s zarr.json against the manifest (None when they agree)."""
    from zeroio.checkpoint.layout import array_metadata
    from zeroio.errors import CheckpointError
    from zeroio.io.files import read_json

    a = m.arrays[kind]
    path = m.tag_dir / kind / "zarr.json"
    try:
        have = read_json(path, f"metadata of array {kind!r}")
    except CheckpointError as e:
        return str(e)
    if a.extents:  # stored as extents: a group naming the layout ([Note: shared extents])
        from zeroio.checkpoint.layout import extents_metadata

        if have != extents_metadata(a.dtype):
            return f"array metadata {path} does not match the manifest {m.path} (extents, dtype); restore it"
        return None
    want = array_metadata(a.numel, a.dtype, a.chunk_elems)
    keys = ("shape", "data_type", "chunk_grid", "codecs")
    if not isinstance(have, dict) or any(have.get(k) != want[k] for k in keys):
        return f"array metadata {path} does not match the manifest {m.path} (shape, dtype or chunks); restore it"
    return None


def _verify(m, progress: bool) -> str | None:
    """Every chunk of every array read and crc-checked, one chunk at a time; the first problem."""
    from zeroio.checkpoint.reader import ArrayReader
    from zeroio.errors import CheckpointError

    reader = ArrayReader(m, progress=progress)
    try:
        for kind in m.arrays:
            problem = _array_problem(m, kind)
            if problem:
                return problem
            reader.verify(kind)
    except CheckpointError as e:
        return str(e)
    return None


def _entry(t, verify: bool, progress: bool) -> dict:
    from zeroio.checkpoint.layout import MANIFEST, read_manifest

    entry = {"tag": t.tag, "complete": t.complete, "path": str(t.path)}
    if not t.complete:
        entry["problem"] = t.reason
        return entry
    m = read_manifest(t.path / MANIFEST)
    hf = m.meta.get("hf_config") or {}
    entry.update({
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix)),
        "world_size": m.world_size,
        "stage": m.meta.get("stage"),
        "model_class": m.meta.get("model_class"),
        "hf_model_type": hf.get("model_type") if isinstance(hf, dict) else None,
        "parameters": len(m.index),
        "numel": m.numel,
        "global_steps": (m.scalars.get("engine") or {}).get("global_steps"),
        "client_state_keys": sorted(m.client_state),
        "arrays": {k: {"dtype": str(a.dtype).removeprefix("torch."), "numel": a.numel,
                       "bytes": a.nbytes, "chunks": a.num_chunks,
                       **({"layout": "extents"} if a.extents else {})} for k, a in m.arrays.items()},
        "bytes": sum(a.nbytes for a in m.arrays.values()),
    })
    if verify:
        problem = _verify(m, progress)
        entry["verified"] = problem is None
        if problem:
            entry["complete"], entry["problem"] = False, problem
    return entry


def describe(root, tag=None, verify=False, progress=False) -> dict:
    from pathlib import Path

    from zeroio.checkpoint.layout import LATEST, read_latest
    from zeroio.checkpoint.reader import check_root
    from zeroio.checkpoint.tags import check_tag, scan_tags, side_folders
    from zeroio.errors import CheckpointError

    root = Path(root)
    check_root(root)
    if tag is not None:
        check_tag(tag)
    from zeroio.checkpoint.deepspeed_inspect import describe as describe_deepspeed

    ds = describe_deepspeed(root, tag, verify)  # a directory DeepSpeed wrote: its own report
    if ds is not None:
        return ds
    scan = scan_tags(root)
    latest = read_latest(root)
    if not scan and latest is None and not (root / LATEST).exists():
        raise CheckpointError(
            f"no zeroio checkpoint in {root}: no tag folder (with zarr.json / manifest.json) and no "
            "`latest`; pass the directory given to save_checkpoint (zeroio train: OUTPUT/checkpoints)")
    tags = [_entry(t, verify, progress) for t in scan if tag is None or t.tag == tag]
    if tag is not None and not tags:
        raise CheckpointError(f"tag {tag!r} not found in {root}; tags: {[t.tag for t in scan]}")
    info = {"checkpoint": str(root), "latest": latest, "tags": tags,
            "leftovers": [str(d) for ds in side_folders(root).values() for d in ds
                          if not any(t["path"] == str(d) for t in tags)]}
    good = {t.tag for t in scan if t.complete}
    if tag is not None:  # one tag asked for: `latest` is not its business
        return info
    if latest is None and (root / LATEST).exists():
        info["problem"] = f"{root / LATEST} is not readable text; the newest complete tag is loaded instead"
    elif latest is not None and latest not in good:
        info["problem"] = (f"`latest` names {latest!r}, which is not a complete checkpoint; loading takes "
                           "the newest complete tag instead")
    return info


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _status(info: dict) -> int:
    return 0 if all(t["complete"] for t in info["tags"]) and "problem" not in info else 1


def run(args) -> int:
    info = describe(args.checkpoint, args.tag, args.verify, progress=not args.json)
    if args.json:
        print(json.dumps(info))
        return _status(info)
    print(f"{info['checkpoint']}  (latest: {info['latest'] or '-'})")
    if "problem" in info:
        print(f"  PROBLEM: {info['problem']}")
    for t in info["tags"]:
        if not t["complete"]:
            print(f"  {t['tag']}: INVALID - {t['problem']}")
            continue
        model = t["hf_model_type"] or t["model_class"] or "the model"
        by = f" with {t['writer']}" if t.get("writer") else ""
        print(f"  {t['tag']}: written {t['created']}{by} by {t['world_size']} rank(s) at stage {t['stage']}, "
              f"step {t['global_steps']}; {t['parameters']} parameters ({t['numel']:,} elements) of {model}; "
              f"{_human(t['bytes'])}" + ("; verified" if t.get("verified") else ""))
        for k, a in t["arrays"].items():
            print(f"    {k:<12} {a['dtype']:<9} {a['numel']:>14,} elements  {_human(a['bytes']):>10}  "
                  + {"extents": f"{a['chunks']} shared extent(s)", "deepspeed": f"{a['chunks']} rank file(s)"}
                  .get(a.get("layout"), f"{a['chunks']} chunk(s)"))
        if t["client_state_keys"]:
            print(f"    client_state: {', '.join(t['client_state_keys'])}")
    for d in info["leftovers"]:
        print(f"  (left by an interrupted save, removed by the next save: {d})")
    return _status(info)
