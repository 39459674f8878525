"""Continuing a run started on DeepSpeed: its ZeRO checkpoint loaded into a zeroio engine.

`find` tells a DeepSpeed checkpoint directory from a zeroio one by its files ([Note:
DeepSpeed's ZeRO layout] in deepspeed_layout.py); `DeepSpeedLoad` then does what
`reader.ShardedLoad` does for a zeroio checkpoint, with the same two steps ([Note: verify,
then apply] in reader.py): `verify` checks the zip CRC-32 of every tensor member this rank
will read, writing nothing; `apply` reads each parameter's pieces, by name, into this rank's
segments. A parameter's values are found by name, not by rank, so any world size and stage
resumes any DeepSpeed world size and stage.

What is carried over: the fp32 masters (the weights: 16-bit parameters are republished from
them), the optimizer's states (Adam: exp_avg, exp_avg_sq) and step counts and param-group
hyperparameters, the LR scheduler's state, ``global_steps`` / ``global_samples`` /
``skipped_steps``, the loss scaler, persistent buffers and the client state. DeepSpeed saves
no RNG state and no micro-step count; the accumulation window starts afresh (as on DeepSpeed).
"""

from __future__ import annotations

import base64
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroio.checkpoint import deepspeed_layout as dsl
from zeroio.checkpoint import layout, tags
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.reader import LoadResult, model_mismatch
from zeroio.checkpoint.state import (
    LazySegment,
    ParamEntry,
    ShardedState,
    build_index,
    split_by_param,
)
from zeroio.errors import CheckpointError
from zeroio.io.torch_file import Record, StorageRef, TensorRef, verify_member

READ_PIECE = 1 << 22  # elements per read of one piece (16 MB of fp32)
#: DeepSpeed optimizer types -> zeroio's rule names ([Note: optimizer rule in a checkpoint]).
_RULES = {"adam": "adam", "adamw": "adam", "fusedadam": "adam", "cpuadam": "adam", "lamb": "lamb",
          "lion": "lion", "adagrad": "adagrad", "sgd": "sgd"}


def find(root: str | os.PathLike, tag: str | None) -> dsl.DeepSpeedTag | None:
    """The parsed DeepSpeed tag ``tag`` (None: the one ``latest`` names) of ``root``; None when
    ``root`` is a zeroio checkpoint directory (or nothing zeroio's reader should not report
    itself). A folder of neither kind is a CheckpointError saying what is in it."""
    root = Path(root)
    if not root.is_dir() or tags.is_tag_folder(root):
        return None  # zeroio's reader says what to pass
    if dsl.is_deepspeed_tag(root):
        raise CheckpointError(f"{root} is the folder of DeepSpeed checkpoint tag {root.name!r}, not the "
                              f"checkpoint directory: pass its parent {root.parent} and tag={root.name!r}")
    if tag is None:
        tag = _latest(root)
    elif not _one_folder(tag):
        return None  # zeroio's reader names the rule a tag follows
    if tag is not None and dsl.is_deepspeed_tag(root / tag):
        return dsl.parse_tag(root / tag)
    if (root / "latest_universal").is_file():
        raise dsl._refuse(root, "a DeepSpeed universal checkpoint (latest_universal)", ["latest_universal"])
    if _has_zeroio(root):
        return None  # zeroio's: its reader reports a missing or broken tag
    ds_tags = sorted(p.name for p in root.iterdir() if dsl.is_deepspeed_tag(p))
    if ds_tags:
        which = f"not {tag!r}" if tag else "and no `latest` file"
        raise CheckpointError(f"{root} is a DeepSpeed checkpoint directory with tags {ds_tags}, {which}: "
                              "pass one of them as tag")
    _other_layout(root)
    return None


def _has_zeroio(root: Path) -> bool:
    """Anything of zeroio's layout in ``root`` (a tag folder, complete or not; a copy beside one)."""
    for p in root.iterdir():
        if p.is_dir() and ((p / "zarr.json").exists() or (p / layout.MANIFEST).exists()):
            return True
    return bool(tags.side_folders(root))


def _one_folder(tag) -> bool:
    """``tag`` names one folder inside the directory (DeepSpeed's tags are any such name)."""
    return isinstance(tag, str) and bool(tag) and "/" not in tag and "\0" not in tag \
        and tag not in (".", "..")


def _latest(root: Path) -> str | None:
    tag = layout.read_latest(root)
    return tag if _one_folder(tag) else None


def _other_layout(root: Path) -> None:
    """A non-empty folder of neither zeroio's nor DeepSpeed's layout: say what it holds."""
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir() if not p.name.startswith("."))
    if not entries or entries == [layout.LATEST]:
        return  # empty: zeroio's reader says "no complete checkpoint"
    hint = ""
    if any(e.endswith((".safetensors", ".bin")) or e == "config.json" for e in entries):
        hint = (" It looks like a model folder (weights, no training state): load it with "
                "from_pretrained (inside zeroio.zero.Init at stage 3) and start training from it.")
    raise CheckpointError(
        f"no zeroio checkpoint in {root}, and no DeepSpeed one: it has neither zeroio's layout (tag "
        "folders with zarr.json and manifest.json) nor DeepSpeed's (tag folders with "
        "*_model_states.pt and *_optim_states.pt, a `latest` file naming one). "
        f"Found: {', '.join(entries[:8])}{', ...' if len(entries) > 8 else ''}.{hint}")


def _plain(v: Any) -> Any:
    """A DeepSpeed value as plain Python: tensors read, records as dicts (Namespace as itself)."""
    if isinstance(v, TensorRef):
        return v.load()
    if isinstance(v, Record):
        if v.qualname == "Namespace":
            import argparse

            return argparse.Namespace(**{k: _plain(x) for k, x in v.state.items()})
        return {k: _plain(x) for k, x in v.state.items()} if v.state else _plain(list(v.args))
    if isinstance(v, Mapping):
        return type(v)((k, _plain(x)) for k, x in v.items()) if isinstance(v, dict) else dict(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _number(v: Any, what: str) -> float:
    if isinstance(v, TensorRef):
        v = v.load().item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointError(f"{what} is {v!r}, not a number")
    return v


def _steps(tag: dsl.DeepSpeedTag) -> list[int]:
    """The optimizer's step count per param group (the max over its flat groups and ranks)."""
    out = [0] * len(tag.param_groups())
    for r in range(tag.world_size):
        elastic = tag.optim[r].get("base_optimizer_state_step")
        for f, g in enumerate(tag.group_of_flat):
            step = tag.group_state(r, f).get("step", elastic if elastic is not None else 0)
            out[g] = max(out[g], int(_number(step, f"{tag.path}: rank {r} group {f} step")))
    return out


def _hyper(group: dict) -> dict:
    keep = {}
    for k, v in group.items():
        if k == "params":
            continue
        v = _plain(v)
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, (bool, int, float, str, list)):
            keep[k] = v
    return keep


def _rule(tag: dsl.DeepSpeedTag) -> str:
    cfg = tag.model_states.get("ds_config")
    opt = cfg.get("optimizer") if isinstance(cfg, dict) else None
    name = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
    if name in _RULES:
        return _RULES[name]
    kinds = set(tag.group_state(0, 0))  # a client optimizer: named by the states it keeps
    for rule, have in (("adam", {"exp_avg", "exp_avg_sq"}), ("lion", {"exp_avg"}), ("adagrad", {"sum"}),
                       ("sgd", {"momentum_buffer"})):
        if have <= kinds:
            return rule
    return name or "unknown"


def _loss_scaler(tag: dsl.DeepSpeedTag) -> dict:
    rec = tag.optim[0].get("loss_scaler")
    st = rec.state if isinstance(rec, Record) else {}
    if "cur_scale" not in st:
        return {"cur_scale": 1.0, "dynamic": False}
    out = {"cur_scale": float(_number(st["cur_scale"], f"{tag.path}: loss_scaler.cur_scale")),
           "dynamic": bool(st.get("dynamic", False))}
    for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
        if isinstance(st.get(key), int):
            out[key] = st[key]
    return out


def _buffers(tag: dsl.DeepSpeedTag) -> dict[str, dict]:
    """The persistent buffers of the model states, in the engine's checkpoint form."""
    module = tag.model_states.get("module") or {}
    out = {}
    for name in tag.model_states.get("buffer_names") or []:
        ref = module.get(name)
        if not isinstance(ref, TensorRef):
            continue
        t = ref.load().contiguous()
        out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                     "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode()}
    return out


def scalars(tag: dsl.DeepSpeedTag, micro_per_step: int) -> dict[str, Any]:
    """The checkpoint's counters and small state in the form zeroio's own checkpoints hold them
    (engine_io: ``scalars``). ``micro_per_step``: the loading engine's gradient accumulation
    steps, so its next micro step opens a window, as on DeepSpeed after a load."""
    ms = tag.model_states
    counters = {k: int(_number(ms.get(k, 0), f"{tag.path}: {k}"))
                for k in ("global_steps", "global_samples", "skipped_steps")}
    sched = ms.get("lr_scheduler")
    return {
        "engine": {**counters, "micro_steps": counters["global_steps"] * micro_per_step,
                   "last_grad_norm": None},
        "optimizer": {"param_groups": [_hyper(g) for g in tag.param_groups()], "steps": _steps(tag),
                      "rule": _rule(tag)},
        "lr_scheduler": _plain(sched) if isinstance(sched, dict) else None,
        "loss_scaler": _loss_scaler(tag),
        "buffers": _buffers(tag),
        "frozen": list(tag.frozen),
    }


def client_state(tag: dsl.DeepSpeedTag) -> dict[str, Any]:
    """What the client passed to DeepSpeed's save_checkpoint (tensors read)."""
    return {k: _plain(v) for k, v in tag.model_states.items() if k not in dsl.DS_KEYS}


def manifest(tag: dsl.DeepSpeedTag, micro_per_step: int = 1) -> layout.Manifest:
    """A manifest describing the DeepSpeed tag (no arrays: its values are read by piece)."""
    names = list(tag.shapes) + [n for n in tag.frozen if n not in tag.shapes]
    shapes = {**tag.frozen, **tag.shapes}
    files = [p for p in tag.path.iterdir() if p.is_file()]
    return layout.Manifest(
        path=tag.path / "mp_rank_00_model_states.pt" if tag.stage != 3 else
        tag.path / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        tag=tag.tag, world_size=tag.world_size, index=build_index([(n, shapes[n]) for n in names]),
        arrays={}, scalars=scalars(tag, micro_per_step), rank_scalars=[], client_state=client_state(tag),
        meta={"stage": tag.stage, "writer": f"deepspeed {tag.version}", "hf_config": None,
              "model_class": None, "compute_dtype": "bf16" if tag.bf16_files else None},
        created_unix=max((p.stat().st_mtime for p in files), default=time.time()))


@dataclass(frozen=True, kw_only=True)
class _Read:
    """Elements [src_lo, src_lo + n) of ``src`` go to element ``dst_lo`` of a segment."""

    src: TensorRef
    src_lo: int
    n: int
    segment: Any
    dst_lo: int


def _stored_name(tag: dsl.DeepSpeedTag, name: str) -> str | None:
    if name in tag.shapes or name in tag.frozen:
        return name
    target = tag.shared.get(name)
    if target is not None:
        return target
    back = [k for k, v in tag.shared.items() if v == name and (k in tag.shapes or k in tag.frozen)]
    return back[0] if back else None


def check_model(tag: dsl.DeepSpeedTag, index: Mapping[str, ParamEntry], strict: bool) -> dict[str, str]:
    """Model name -> the name DeepSpeed stored it under, for the parameters to load. strict: the
    model must be the checkpoint's (names, tied names and shapes)."""
    shapes = {**tag.frozen, **tag.shapes}
    stored = {n: _stored_name(tag, n) for n in index}
    missing = [n for n, s in stored.items() if s is None]
    differ = [n for n, s in stored.items() if s is not None and shapes[s] != tuple(index[n].shape)]
    used = {s for s in stored.values() if s is not None}
    unexpected = [n for n in shapes if n not in used]
    if strict and (missing or unexpected or differ):
        first = differ[0] if differ else None
        shape = (len(differ), first, shapes[stored[first]], index[first].shape) if differ else None
        raise CheckpointError(f"DeepSpeed checkpoint {tag.path} is of another model: "
                              f"{model_mismatch(missing, unexpected, shape)}. "
                              "Load with strict=False to take the matching parameters only.")
    return {n: s for n, s in stored.items() if s is not None and n not in differ}


def locate(tag: dsl.DeepSpeedTag, kind: str, name: str) -> list[tuple[int, TensorRef, int, int]]:
    """(element of the parameter, tensor, its first element, n) runs holding ``kind`` of
    parameter ``name`` (a stored name)."""
    if name in tag.frozen and name not in tag.shapes:
        if kind != "fp32":
            raise CheckpointError(f"{tag.path}: parameter {name!r} was frozen on DeepSpeed and has no "
                                  f"{kind!r}; load with load_optimizer_states=False or freeze it here too")
        return dsl.frozen_pieces(tag, name)
    return [(p.param_lo, tag.flat(kind, p.rank, p.group), p.flat_lo, p.n) for p in tag.pieces[name]]


class DeepSpeedLoad:
    """`reader.ShardedLoad`'s interface over a DeepSpeed tag: ``manifest``, `verify`, `apply`."""

    def __init__(self, tag: dsl.DeepSpeedTag, template: ShardedState, *, kinds, strict: bool = True,
                 comm: Comm | None = None, micro_per_step: int = 1):
        self.tag, self.template = tag, template
        self.comm = comm or Comm.default()
        self.manifest = manifest(tag, micro_per_step)
        self.names = check_model(tag, template.index, strict)
        self.kinds = list(kinds)
        self.reads = {kind: self._plan(kind) for kind in self.kinds}

    def _plan(self, kind: str) -> list[_Read]:
        index, out = self.template.index, []
        for seg in self.template.arrays[kind]:
            for name, lo, hi in split_by_param(index, seg.offset, seg.end):
                if name not in self.names:
                    continue
                a, b = lo - index[name].offset, hi - index[name].offset
                for at, ref, ref_lo, n in locate(self.tag, kind, self.names[name]):
                    x, y = max(a, at), min(b, at + n)
                    if x < y:
                        out.append(_Read(src=ref, src_lo=ref_lo + x - at, n=y - x, segment=seg,
                                         dst_lo=lo - seg.offset + x - a))
        return out

    def verify(self) -> None:
        """The zip CRC-32 of every tensor member this rank reads; nothing is written."""
        seen: dict[tuple[Path, str], StorageRef] = {}
        for reads in self.reads.values():
            for r in reads:
                seen.setdefault((r.src.storage.path, r.src.storage.member), r.src.storage)
        for storage in seen.values():
            verify_member(storage)

    def rank_scalars(self) -> dict[str, Any]:
        """DeepSpeed saves no per-rank scalars (no RNG state): nothing to restore per rank."""
        return {}

    def apply(self) -> LoadResult:
        for reads in self.reads.values():
            for r in reads:
                for lo in range(0, r.n, READ_PIECE):
                    n = min(READ_PIECE, r.n - lo)
                    _put(r.segment, r.dst_lo + lo, r.src.read(r.src_lo + lo, n))
        m, index = self.manifest, self.template.index
        return LoadResult(manifest=m, path=self.tag.path, tag=self.tag.tag, scalars=m.scalars, rank_scalars={},
                          client_state=m.client_state,
                          loaded_names=[n for n in index if n in self.names],
                          skipped_names=[n for n in index if n not in self.names])


def _put(segment, lo: int, values: torch.Tensor) -> None:
    if isinstance(segment, LazySegment):
        segment.write(lo, values.to(segment.dtype))
    else:
        segment.tensor.reshape(-1)[lo: lo + values.numel()].copy_(values)


def consolidate(tag: dsl.DeepSpeedTag, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of the DeepSpeed tag as a full fp32 tensor (``dtype`` if given), in the
    model's order (the module state_dict's), tied parameters once."""
    module = tag.model_states.get("module") or {}
    order = [n for n in module if n in tag.shapes or n in tag.frozen]
    order += [n for n in [*tag.shapes, *tag.frozen] if n not in order]
    runs = {name: locate(tag, "fp32", name) for name in order}
    storages = {(r.storage.path, r.storage.member): r.storage for rs in runs.values() for _a, r, _l, _n in rs}
    for storage in storages.values():  # a damaged file is an error, never wrong weights
        verify_member(storage)
    out = {}
    for name in order:
        shape = tag.shapes.get(name, tag.frozen.get(name))
        flat = torch.empty(math.prod(shape), dtype=torch.float32)
        for at, ref, ref_lo, n in runs[name]:
            flat[at: at + n] = ref.read(ref_lo, n)
        out[name] = flat.view(shape) if dtype is None else flat.view(shape).to(dtype)
    return out
