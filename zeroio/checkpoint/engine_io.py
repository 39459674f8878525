"""Engine <-> checkpoint: build a `ShardedState` from a live engine, apply one back.

The engine methods `save_checkpoint` and `load_checkpoint` delegate here
(`save_16bit_model`: export16.py). What is read from the engine (docs/engine.md):
`partitioner.index` (global flat order), `partitioner.groups` (ShardGroups
with `segments` local -> global), `partitioner.publish_params()`,
`optimizer.local_tensor(i, kind)` / `write_local(i, kind, t)` /
`read_local(i, kind, lo, n)` + `write_local_range` (where `reads_ranges`: state kept
off-host or split; optim/interface.py) /
`steps_taken(i)` / `set_steps(i, n)` / `param_groups`, `lr_scheduler.state_dict()`, `loss_scaler.state_dict()`, and
the counters `global_steps`, `micro_steps`, `global_samples`, `skipped_steps`.

[Note: optimizer rule in a checkpoint] The state arrays are the optimizer's ``state_kinds``
(Adam, Lamb: exp_avg, exp_avg_sq; Lion: exp_avg; Adagrad: sum; SGD: momentum_buffer);
``scalars.optimizer.rule`` names the rule (absent: "adam"). Loading one rule's state into
another is a ``CheckpointError`` before anything is read.

[Note: what a checkpoint holds] Arrays "fp32", "exp_avg", "exp_avg_sq" over
the global flat order, each rank writing its ShardGroup segments (stage 0:
rank 0 only, every rank holds everything). Parameters in no ShardGroup
(frozen) are written by rank 0 from the module, with zero moments.
Scalars: counters, optimizer hyperparameters and step counts, scheduler,
loss scaler, persistent module buffers. Per rank: RNG states. The fp32
masters are the weights: 16-bit parameters are republished from them on
load, so a resume is bit-exact in fp32 and needs no 16-bit array. NVMe-resident
moments go in as their swap files, shared, where the file systems allow
([Note: shared extents] in shared.py).

[Note: state dtypes in a checkpoint] Each array is stored in the dtype the engine keeps it in
(``kind_dtype``): "fp32" is the masters' array whatever their dtype (bf16 with
``bf16.bf16_master_weights_and_grads``), the moments are bf16 with
``bf16.bf16_optimizer_states``; the manifest and zarr metadata name the dtype. A load converts
the stored dtype to the engine's: bf16 -> fp32 is exact, fp32 -> bf16 rounds to nearest-even
(what the first bf16 step would do), so either setting resumes the other's checkpoint.
"""

from __future__ import annotations

import base64
import json
import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zeroio import jsonlimits
from zeroio.checkpoint import deepspeed_load, rng
from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.deepspeed_load import DeepSpeedLoad
from zeroio.checkpoint.layout import CheckpointWarning
from zeroio.checkpoint.reader import ShardedLoad, resolve_tag
from zeroio.checkpoint.scalars_check import BUFFER_DTYPES, Checked, check_scalars
from zeroio.checkpoint.state import (
    LazySegment,
    ParamEntry,
    Segment,
    ShardedState,
    SharedFile,
    split_by_param,
)
from zeroio.checkpoint.tags import check_tag
from zeroio.checkpoint.writer import SaveOptions, existing_parent, save_sharded_report
from zeroio.dtypes import DTYPES
from zeroio.errors import CheckpointError
from zeroio.io.links import same_device
from zeroio.partition import collectives

OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq")  # Adam's; an engine's: optimizer.state_kinds


def kind_dtype(engine, kind: str) -> torch.dtype:
    """The dtype ``kind`` is kept (and saved) in: [Note: state dtypes in a checkpoint]."""
    b = engine.config.bf16
    return DTYPES[b.master_dtype if kind == "fp32" else b.optimizer_state_dtype]


def _comm(engine) -> Comm:
    part = engine.partitioner
    return Comm.default(part.group)


def _index(engine) -> dict[str, ParamEntry]:
    return {e.name: ParamEntry(offset=e.offset, shape=tuple(e.shape)) for e in engine.partitioner.index.entries}


def _owns_shards(engine, comm: Comm) -> bool:
    """Stage 0 keeps everything on every rank: only rank 0 writes."""
    return engine.partitioner.stage != 0 or comm.rank == 0


def _segments(engine, kind: str, comm: Comm) -> list[Segment]:
    return _shard_segments(engine, kind) if _owns_shards(engine, comm) else []


def _save_segments(engine, kind: str, comm: Comm) -> list[Segment | LazySegment]:
    """As `_segments`, but state the optimizer keeps off-host (``read_local``: NVMe-resident
    moments; fp32 masters of a stage-3 group split between device and host by
    offload_optimizer.ratio) is read piece by piece while it is written: no whole host copy
    per state."""
    if not engine.optimizer.reads_ranges or not _owns_shards(engine, comm):
        return _segments(engine, kind, comm)
    read_local = engine.optimizer.read_local
    out: list[Segment | LazySegment] = []
    for g in engine.partitioner.groups:
        for s in g.segments:
            if s.numel:
                out.append(LazySegment(offset=s.global_offset, numel=s.numel,
                                       dtype=kind_dtype(engine, kind),
                                       read=partial(_read_local, read_local, g.group_index, kind,
                                                    s.local_offset)))
    return out


def _load_segments(engine, kind: str, locals_out: dict) -> list[Segment | LazySegment]:
    """Segments to load ``kind`` into: state an optimizer keeps off-host or split
    (``read_local`` + ``write_local_range``: NVMe-resident moments; every kind of a stage-3
    group split between device and host by offload_optimizer.ratio, fp32 masters included)
    is written chunk by chunk as the reader verifies each, without a whole host copy
    (``TwinAdam.local_tensor`` of a split group is one: 52 GB of fp32 masters at 13B)."""
    opt = engine.optimizer
    if not opt.reads_ranges:
        return _shard_segments(engine, kind, locals_out)
    write_range, read_local = opt.write_local_range, opt.read_local
    out: list[Segment | LazySegment] = []
    for g in engine.partitioner.groups:
        for s in g.segments:
            if s.numel:
                out.append(LazySegment(
                    offset=s.global_offset, numel=s.numel, dtype=kind_dtype(engine, kind),
                    read=partial(_read_local, read_local, g.group_index, kind, s.local_offset),
                    write=partial(_write_local, write_range, g.group_index, kind, s.local_offset)))
    return out


def _write_local(write_range, group_index: int, kind: str, base: int, lo: int, values: torch.Tensor) -> None:
    write_range(group_index, kind, base + lo, values)


def _read_local(read_local, group_index: int, kind: str, base: int, lo: int, n: int) -> torch.Tensor:
    return read_local(group_index, kind, base + lo, n)


def _shard_segments(engine, kind: str, locals_out: dict | None = None) -> list[Segment]:
    """This rank's ShardGroup segments of ``kind`` as views of the optimizer's local tensors.

    ``local_tensor`` may hand out a host copy (NVMe-resident moments, read
    from the tiered store's CPU/NVMe tiers: no trip through the GPU); such
    optimizers take loaded values back through ``write_local``, so the local
    tensors are collected in ``locals_out``.
    """
    out = []
    for g in engine.partitioner.groups:
        local = engine.optimizer.local_tensor(g.group_index, kind)
        if locals_out is not None:
            locals_out[(g.group_index, kind)] = local
        for s in g.segments:
            out.append(Segment(s.global_offset, local[s.local_offset: s.local_offset + s.numel]))
    return out


def _uncovered(engine, index: dict[str, ParamEntry], comm: Comm) -> list[str]:
    """Parameters in no rank's ShardGroup (frozen ones): a coverage bitmap, max-reduced."""
    names = list(index)
    pos = {n: i for i, n in enumerate(names)}
    covered = torch.zeros(len(names), dtype=torch.int32)  # filled on the host, reduced on comm.device
    for g in engine.partitioner.groups:
        for s in g.segments:
            for name, _lo, _hi in split_by_param(index, s.global_offset, s.global_offset + s.numel):
                covered[pos[name]] = 1
    covered = covered.to(comm.device or "cpu")
    if comm.world_size > 1:
        collectives.all_reduce_scalar(covered, comm.group, op="max")
    return [n for n, c in zip(names, covered.tolist(), strict=True) if not c]


def _module_params(engine) -> dict[str, torch.nn.Parameter]:
    return dict(engine.module.named_parameters())


def _frozen_segments(engine, index, names, kind) -> list[Segment]:
    if engine.partitioner.stage == 3 and names:
        raise CheckpointError(
            f"parameters {names[:3]} belong to no optimizer group; stage 3 checkpoints need every "
            "parameter in an optimizer param group"
        )
    params = _module_params(engine)
    out = []
    for n in names:
        p = params[n].detach().reshape(-1)
        data = p.to(kind_dtype(engine, kind)) if kind == "fp32" else torch.zeros(
            p.numel(), dtype=kind_dtype(engine, kind))
        out.append(Segment(index[n].offset, data))
    return out


def _buffers(module: torch.nn.Module, *, encode: bool) -> dict[str, dict[str, Any]]:
    """The persistent buffers as the manifest holds them (``encode``: rank 0; every rank checks
    their dtypes, so that all refuse a save together)."""
    out = {}
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set:
                continue
            name, dtype = f"{mname}.{bname}" if mname else bname, str(b.dtype)[len("torch."):]
            if dtype not in BUFFER_DTYPES:  # what a load takes: [Note: verify every value ...]
                raise CheckpointError(f"module buffer {name!r} is {dtype}, which a checkpoint "
                                      f"does not hold (one of {sorted(BUFFER_DTYPES)}); make it "
                                      "non-persistent (register_buffer(..., persistent=False))")
            if not encode:
                continue
            host = b.detach().to("cpu").contiguous()
            out[name] = {
                "dtype": dtype, "shape": list(host.shape),
                "data": base64.b64encode(host.reshape(-1).view(torch.uint8).numpy().tobytes()).decode(),
            }
    return out


def _jsonable(value: Any, what: str) -> Any:
    """``value`` as a load will read it back: JSON, within zeroio's limits ([Note: bounded
    JSON] in jsonlimits.py), so no checkpoint is written that its load would refuse."""
    try:
        return jsonlimits.loads(json.dumps(value), what)
    except jsonlimits.JSONLimitError as e:
        raise CheckpointError(f"{e}; a checkpoint holds no deeper state") from None
    except RecursionError:  # json.dumps of a structure nested past Python's recursion limit
        raise CheckpointError(f"{what} is nested deeper than {jsonlimits.MAX_DEPTH} levels; a "
                              "checkpoint holds no deeper state") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serializable ({e}); zeroio checkpoints hold no pickles") from None


def _hf_config(module: torch.nn.Module) -> dict | None:
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return None
    doc = json.loads(cfg.to_json_string(use_diff=False))
    doc.setdefault("architectures", [type(module).__name__])
    if not doc.get("architectures"):
        doc["architectures"] = [type(module).__name__]
    return doc


def _max_steps(engine, comm: Comm) -> list[int]:
    """Adam step count per group; a rank with an empty shard never steps, so take the max."""
    n = len(engine.partitioner.groups)
    steps = torch.tensor([engine.optimizer.steps_taken(i) for i in range(n)], dtype=torch.int64,
                         device=comm.device)
    if comm.world_size > 1:
        collectives.all_reduce_scalar(steps, comm.group, op="max")
    return [int(s) for s in steps.tolist()]


def _hyper(group: dict) -> dict:
    keep = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        try:
            keep[k] = json.loads(json.dumps(v))
        except (TypeError, ValueError):
            continue  # e.g. a client's callable; not part of the resumable state
    return keep


def _shared_files(engine, kind: str, comm: Comm) -> list[SharedFile] | None:
    """The swap files holding this rank's ``kind`` state, with the global runs each holds
    ([Note: shared extents] in shared.py); None when the optimizer keeps it in no files."""
    if not _owns_shards(engine, comm):
        return []
    out = []
    for g in engine.partitioner.groups:
        files = engine.optimizer.swap_files(g.group_index, kind)
        if files is None:
            return None
        segs = sorted((s.local_offset, s.global_offset, s.numel) for s in g.segments if s.numel)
        for path, first, n, nbytes, crc_at in files:
            spans = tuple((lo - first, glob + lo - loc, hi - lo) for loc, glob, sn in segs
                          for lo, hi in [(max(first, loc), min(first + n, loc + sn))] if lo < hi)
            if spans:  # a file of padding only holds nothing of the model
                out.append(SharedFile(path=path, nbytes=nbytes, crc_at=crc_at, spans=spans))
    return out


def _share(engine, kinds, comm: Comm, save_dir) -> tuple[dict[str, list[SharedFile]], int, str | None]:
    """The kinds whose swap files every rank can share, the bytes this rank's flush of its
    dirty pieces wrote, and why nothing is shared (None: shared, or nothing to share).
    Collective: all ranks share, or none does. A checkpoint directory on another file system
    than the swap files is written as chunks, through host memory, as without sharing."""
    flushed = engine.optimizer.flush_swap()
    swapped = getattr(engine.optimizer, "swapped_kinds", engine.optimizer.state_kinds)
    files = {k: _shared_files(engine, k, comm) for k in swapped if k in kinds}
    ok = bool(files) and all(v is not None for v in files.values())
    first = next((f.path for fs in files.values() for f in fs or []), None)
    why = None
    if ok and first is not None and not same_device(first, existing_parent(Path(save_dir))):
        ok, why = False, (f"the checkpoint directory {save_dir} is on another file system than the "
                          f"swap file {first}: the moments were copied through host memory")
    if comm.all_ok(ok):
        return files, flushed, None
    if why is None and all(v is not None for v in files.values()) and files:
        why = "another rank's swap files cannot be shared: the moments were copied through host memory"
    if why is not None:
        warnings.warn(why, CheckpointWarning, stacklevel=4)
    return {}, flushed, why


def build_state(engine, *, kinds=None, comm: Comm | None = None,
                client_state: dict | None = None, share_into=None) -> ShardedState:
    """This rank's `ShardedState` of ``engine`` (collective: coverage and step counts).
    ``kinds``: default "fp32" and the optimizer's ``state_kinds``. ``share_into``: the
    checkpoint directory, when NVMe-resident moments may go in as their swap files
    (``ShardedState.shared``)."""
    comm = comm or _comm(engine)
    kinds = ("fp32", *engine.optimizer.state_kinds) if kinds is None else kinds
    index = _index(engine)
    frozen = _uncovered(engine, index, comm)
    shared, flushed, why = _share(engine, kinds, comm, share_into) if share_into is not None \
        else ({}, 0, None)
    arrays = {}
    for kind in kinds:
        arrays[kind] = [] if kind in shared else _save_segments(engine, kind, comm)
        if comm.rank == 0 and frozen:
            arrays[kind] += _frozen_segments(engine, index, frozen, kind)
    cfg = engine.config
    sched = engine.lr_scheduler
    scalars = {
        "engine": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
                   "last_grad_norm": engine.last_grad_norm},
        "optimizer": {"param_groups": [_hyper(g) for g in engine.optimizer.param_groups],
                      "steps": _max_steps(engine, comm), "rule": engine.optimizer.rule_name},
        "lr_scheduler": _jsonable(sched.state_dict(), "lr_scheduler.state_dict()") if sched is not None
        and hasattr(sched, "state_dict") else None,
        "loss_scaler": _jsonable(engine.loss_scaler.state_dict(), "loss_scaler.state_dict()"),
        "buffers": _buffers(engine.module, encode=comm.rank == 0),
        "frozen": frozen,
    }
    meta = {
        "stage": engine.partitioner.stage,
        "compute_dtype": cfg.compute_dtype,
        "offload_optimizer": cfg.zero_optimization.offload_optimizer.device,
        "offload_param": cfg.zero_optimization.offload_param.device,
        "model_class": f"{type(engine.module).__module__}.{type(engine.module).__qualname__}",
        "hf_config": _hf_config(engine.module),
        "_dtypes": {k: kind_dtype(engine, k) for k in kinds},
        "_swap_flushed": flushed,
        "_share_fallback": why,
    }
    return ShardedState(
        index=index, arrays=arrays, scalars=scalars, rank_scalars={"rng": rng.capture()},
        client_state=_jsonable(client_state or {}, "client_state"), meta=meta, shared=shared,
    )


def _rank_bytes(state: ShardedState) -> int:
    """Bytes of this rank's part of the arrays: what a full copy of it writes."""
    segs = sum((s.numel if isinstance(s, LazySegment) else s.tensor.numel()) * 4
               for segs in state.arrays.values() for s in segs)
    return segs + sum(n * 4 for fs in state.shared.values() for f in fs for _a, _o, n in f.spans)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, *, options: SaveOptions | None = None):
    """Collective: every rank writes its shards of ``engine``'s state as ``save_dir/tag``.
    ``engine.last_save`` then holds this rank's report: ``mode`` ("shared" or "copy"),
    ``seconds``, the counts of ``shared.REPORT_KEYS``, ``fallback`` (why something was copied,
    or None) and ``full_copy_bytes`` (what copying this rank's state would write)."""
    guard = getattr(engine, "_guard", None)
    if guard is not None:  # never a half-applied step: [Note: atomic step] in step_guard.py
        guard.check("save_checkpoint")
    t0 = time.perf_counter()
    tag = check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    comm = _comm(engine)
    opts = options or SaveOptions(progress=engine.global_rank == 0 and engine.show_progress)
    if options is None:  # the aio block sizes the checkpoint's I/O too ([Note: pool settings])
        opts = replace(opts, aio=engine.config.aio)
    state = build_state(engine, comm=comm, client_state=client_state,
                        share_into=save_dir if opts.share_swap else None)
    path, report = save_sharded_report(state, save_dir, tag, comm=comm, options=opts)
    engine.last_save = report | {
        "fallback": report["fallback"] or state.meta["_share_fallback"],
        "mode": "shared" if state.shared else "copy", "full_copy_bytes": _rank_bytes(state),
        "seconds": time.perf_counter() - t0}
    return path


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states=True,
                    load_lr_scheduler_states=True, strict=True):
    """Collective: every rank reads its own ranges; returns ``(tag_dir, client_state)``.

    All or nothing ([Note: verify, then apply] in reader.py): every rank first checks the
    manifest, the model and every chunk it will read, and the scalars; if any rank finds a
    problem, every rank raises and the engine is exactly as it was. Should applying still
    fail, the engine is marked unusable (`engine.step()` raises) until a load succeeds."""
    comm = _comm(engine)
    kinds = ("fp32", *engine.optimizer.state_kinds) if load_optimizer_states else ("fp32",)
    index = _index(engine)
    frozen = _uncovered(engine, index, comm)
    err, load, locals_, frozen_buf, checked = None, None, {}, {}, None
    try:
        ds = deepspeed_load.find(load_dir, tag)  # a tag DeepSpeed wrote, else None (zeroio's)
        if load_optimizer_states:
            _check_rule(engine, deepspeed_load.manifest(ds) if ds else resolve_tag(load_dir, tag, warn=False))
        # every rank reads its shards (stage 0: all of them) and every frozen parameter whole
        arrays = {k: _load_segments(engine, k, locals_) for k in kinds}
        frozen_buf = {n: torch.empty(index[n].numel, dtype=torch.float32) for n in frozen}
        arrays["fp32"] += [Segment(index[n].offset, frozen_buf[n]) for n in frozen]
        template = ShardedState(index=index, arrays=arrays)
        load = DeepSpeedLoad(ds, template, kinds=kinds, strict=strict, comm=comm,
                             micro_per_step=engine.gradient_accumulation_steps()) if ds else \
            ShardedLoad(load_dir, tag, template, kinds=kinds, strict=strict, comm=comm, aio=engine.config.aio)
        checked = check_scalars(engine, load.manifest, load.rank_scalars(),
                                load_optimizer_states=load_optimizer_states,
                                load_lr_scheduler_states=load_lr_scheduler_states)
        load.verify()
    except Exception as e:  # noqa: BLE001 - re-raised below, once every rank knows
        err = e
    if not comm.all_ok(err is None):
        if err is not None:
            raise err
        raise CheckpointError("checkpoint load failed on another rank (see its error); this engine "
                              "is unchanged")
    try:
        res = _apply(engine, load, checked, frozen_buf, locals_, load_optimizer_states,
                     load_lr_scheduler_states)
    except Exception as e:  # noqa: BLE001 - re-raised below, once every rank knows
        err = e
    if not comm.all_ok(err is None):
        why = f"loading {load.manifest.tag_dir} failed after it was verified" + (f": {err}" if err else
                                                                                " on another rank")
        engine._load_failure = (f"{why}; the engine's state is partly loaded, so it cannot train: load "
                                "a checkpoint again")
        raise CheckpointError(engine._load_failure) from err
    engine.partitioner.publish_params()  # collective: only once every rank has its state
    engine._load_failure = None
    return str(res.path), res.client_state


def _apply(engine, load: ShardedLoad, checked: Checked, frozen_buf, locals_,
           load_optimizer_states: bool, load_lr_scheduler_states: bool):
    """Write a verified load into this rank's state (the only step of a load that changes it;
    no collective, so a rank that fails here cannot leave the others waiting). A load of every
    parameter writes every element of its kinds: state kept in swap pieces is replaced whole,
    never read first ([Note: a load replaces pieces whole] in optim/swap_state.py), so a
    missing or damaged swap file does not stop the load that replaces it."""
    whole = set(load.template.index) <= set(load.names)
    with engine.optimizer.replacing(tuple(load.kinds) if whole else ()):
        res = load.apply()
    params = _module_params(engine)
    for n, buf in frozen_buf.items():
        if n in res.loaded_names:
            params[n].data.copy_(buf.view(params[n].shape))
    _apply_scalars(engine, res, checked, load_optimizer_states, load_lr_scheduler_states)
    # local tensors may be copies (NVMe-resident state, or fp32 of a TwinAdam group split
    # between device and host): hand them back before publishing
    for (gi, kind), t in locals_.items():
        engine.optimizer.write_local(gi, kind, t)
    return res


def _check_rule(engine, manifest) -> None:
    """The checkpoint's optimizer rule is the engine's ([Note: optimizer rule in a checkpoint])."""
    opt = manifest.scalars.get("optimizer")
    saved = opt.get("rule", "adam") if isinstance(opt, dict) else "adam"
    live = engine.optimizer.rule_name
    if saved != live:
        raise CheckpointError(
            f"checkpoint {manifest.path} holds {saved!r} optimizer state but the engine's "
            f"optimizer is {live!r}: configure optimizer.type as when it was saved, or load "
            "with load_optimizer_states=False (weights only)")


def _apply_scalars(engine, res, checked: Checked, load_optimizer_states: bool,
                   load_lr_scheduler_states: bool) -> None:
    """Set what ``check_scalars`` passed ([Note: verify every value before apply] in
    scalars_check.py)."""
    s = res.scalars
    e = s["engine"]
    engine.global_steps = int(e["global_steps"])
    engine.micro_steps = int(e["micro_steps"])
    engine.global_samples = int(e["global_samples"])
    engine.skipped_steps = int(e["skipped_steps"])
    engine.last_grad_norm = e.get("last_grad_norm")
    if load_optimizer_states:
        opt = s["optimizer"]
        for i, n in enumerate(opt["steps"]):
            engine.optimizer.set_steps(i, n)
        for live, saved in zip(engine.optimizer.param_groups, opt["param_groups"], strict=False):
            for k, v in saved.items():
                if k in live and not callable(live[k]):
                    live[k] = tuple(v) if isinstance(live[k], tuple) else v
    sched = engine.lr_scheduler
    if load_lr_scheduler_states and sched is not None and s.get("lr_scheduler") is not None:
        sched.load_state_dict(s["lr_scheduler"])
    engine.loss_scaler.load_state_dict(s["loss_scaler"])
    live = dict(engine.module.named_buffers())
    for name, value in checked.buffers.items():
        live[name].data.copy_(value)
    if res.rank_scalars.get("rng"):
        rng.restore(res.rank_scalars["rng"])
