"""What a DeepSpeed checkpoint directory holds, in the form `zeroio inspect` prints for its own."""

from __future__ import annotations

import math
import time
from pathlib import Path

from zeroio.checkpoint import deepspeed_layout as dsl
from zeroio.checkpoint import deepspeed_load, layout
from zeroio.errors import CheckpointError
from zeroio.io.torch_file import StorageRef, TensorRef, verify_member


def _storages(obj, out: dict) -> None:
    if isinstance(obj, TensorRef):
        out[(obj.storage.path, obj.storage.member)] = obj.storage
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)


def verify(tag: dsl.DeepSpeedTag) -> str | None:
    """Every tensor member of every file of the tag read and CRC-checked; the first problem."""
    found: dict[tuple[Path, str], StorageRef] = {}
    for obj in [*tag.rank_model_states.values(), *tag.optim]:
        _storages(obj, found)
    try:
        for storage in found.values():
            verify_member(storage)
    except CheckpointError as e:
        return str(e)
    return None


def _entry(root: Path, name: str, do_verify: bool) -> dict:
    try:
        tag = dsl.parse_tag(root / name)
    except CheckpointError as e:
        return {"tag": name, "complete": False, "path": str(root / name), "problem": str(e)}
    numel = sum(math.prod(s) for s in {**tag.frozen, **tag.shapes}.values())
    kinds = ["fp32", *[k for k, v in tag.group_state(0, 0).items() if isinstance(v, TensorRef) and v.numel > 1]]
    m = deepspeed_load.manifest(tag)
    entry = {
        "tag": name, "complete": True, "path": str(tag.path), "writer": f"DeepSpeed {tag.version}",
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix)),
        "world_size": tag.world_size, "stage": tag.stage, "model_class": None, "hf_model_type": None,
        "parameters": len(m.index), "numel": numel,
        "global_steps": m.scalars["engine"]["global_steps"], "client_state_keys": sorted(m.client_state),
        "arrays": {k: {"dtype": "float32", "numel": numel, "bytes": numel * 4, "chunks": tag.world_size,
                       "layout": "deepspeed"} for k in kinds},
        "bytes": numel * 4 * len(kinds),
    }
    if do_verify:
        problem = verify(tag)
        entry["verified"] = problem is None
        if problem:
            entry["complete"], entry["problem"] = False, problem
    return entry


def describe(root, tag: str | None = None, do_verify: bool = False) -> dict | None:
    """`zeroio inspect`'s report of a DeepSpeed checkpoint directory; None when ``root`` is not one."""
    root = Path(root)
    if deepspeed_load.find(root, tag) is None:
        return None
    names = sorted(p.name for p in root.iterdir() if dsl.is_deepspeed_tag(p))
    if tag is not None:
        names = [n for n in names if n == tag]
    latest = layout.read_latest(root)
    info = {"checkpoint": str(root), "latest": latest, "format": "deepspeed",
            "tags": [_entry(root, n, do_verify) for n in names], "leftovers": []}
    if tag is None and latest is not None and latest not in names:
        info["problem"] = f"`latest` names {latest!r}, which is not a DeepSpeed tag folder here"
    return info
