"""Consolidated 16-bit export of a live engine: the full weights gathered from the fp32 shards.

``Engine.save_16bit_model`` delegates to ``save_16bit_model`` here: collective, window by
window reduced onto rank 0 and streamed into a safetensors folder (+ HF config.json).
``gather_weights`` is the whole-model in-memory variant (small models, tests). The engine
reads are engine_io's (``_save_segments``, frozen parameters from the module).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.consolidate import (
    DEFAULT_MAX_SHARD_BYTES,
    TensorSpec,
    _write_config,
    plan_shards,
    stream_shards,
)
from zeroio.checkpoint.engine_io import (
    _comm,
    _frozen_segments,
    _hf_config,
    _index,
    _save_segments,
    _uncovered,
)
from zeroio.checkpoint.state import LazySegment, Segment, split_by_param
from zeroio.dtypes import DTYPES
from zeroio.errors import CheckpointError
from zeroio.io.export_dir import ExportFolder
from zeroio.partition import collectives

_GATHER_WINDOW = 1 << 25  # elements per reduce when gathering 16-bit weights


def _weight_segments(engine, index, comm: Comm) -> list[Segment | LazySegment]:
    """This rank's fp32 masters (read by range where the optimizer keeps them split or
    off-host: no whole-group host copy) and, on rank 0, the frozen parameters."""
    segs = _save_segments(engine, "fp32", comm)
    frozen = _uncovered(engine, index, comm)
    if comm.rank == 0 and frozen:
        segs += _frozen_segments(engine, index, frozen, "fp32")
    return segs


def _gather_window(segs, lo: int, hi: int, comm: Comm) -> torch.Tensor | None:
    """Elements [lo, hi) of the global fp32 masters, reduced onto rank 0 (None elsewhere).
    Every rank contributes its segments' overlap; the others add zeros (x + 0 is exact)."""
    buf = torch.zeros(hi - lo, dtype=torch.float32, device=comm.device)
    for s in segs:
        a, b = max(lo, s.offset), min(hi, s.end)
        if a < b:
            src = s.read(a - s.offset, b - a) if isinstance(s, LazySegment) else \
                s.tensor[a - s.offset: b - s.offset]
            buf[a - lo: b - lo].copy_(src)
    if comm.world_size > 1:
        collectives.reduce(buf, 0, comm.group)
    return buf if comm.rank == 0 else None


def gather_weights(engine, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Full weights on rank 0 (None elsewhere), reduced window by window from the fp32 shards.

    The result is a whole-model host copy: for small models and tests. ``save_16bit_model``
    streams instead."""
    comm = _comm(engine)
    index = _index(engine)
    dtype = dtype or DTYPES[engine.config.compute_dtype]
    segs = _weight_segments(engine, index, comm)
    total = sum(e.numel for e in index.values())
    out = {n: torch.empty(e.shape, dtype=dtype) for n, e in index.items()} if comm.rank == 0 else None
    for lo in range(0, total, _GATHER_WINDOW):
        hi = min(total, lo + _GATHER_WINDOW)
        buf = _gather_window(segs, lo, hi, comm)
        if out is not None:
            host = buf.cpu()
            for name, a, b in split_by_param(index, lo, hi):
                e = index[name]
                out[name].view(-1)[a - e.offset: b - e.offset].copy_(host[a - lo: b - lo])
    return out


def save_16bit_model(engine, save_dir, *, max_shard_bytes: int | None = None,
                     dtype: torch.dtype | None = None) -> Path | None:
    """Consolidated 16-bit (compute dtype, or ``dtype``) safetensors folder on rank 0 (+ HF config.json).

    Collective and streamed: every rank walks the files' tensors in the same order, each
    window of at most ``STREAM_WINDOW`` elements is reduced onto rank 0 from the ranks'
    fp32 masters (read by range, so a group split by offload_optimizer.ratio is never
    copied whole), cast and appended to its file. Host memory: one window, not the model."""
    zc = engine.config.zero_optimization
    if zc.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
        raise CheckpointError(
            "save_16bit_model at stage 3 gathers the full weights only when "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save is true; set it, or "
            "save_checkpoint(...) and run `zeroio consolidate CKPT OUT --dtype bf16`"
        )
    comm = _comm(engine)
    index = _index(engine)
    dtype = dtype or DTYPES[engine.config.compute_dtype]
    segs = _weight_segments(engine, index, comm)
    specs = [TensorSpec(name=n, shape=e.shape, dtype=dtype) for n, e in index.items()]
    shards = plan_shards(specs, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    rank0 = comm.rank == 0
    out = Path(save_dir)
    # rank 0 writes beside out and replaces an earlier export whole ([Note: replacing an export])
    stage = ExportFolder(out) if rank0 else None

    def fill(spec: TensorSpec, lo: int, n: int) -> torch.Tensor | None:
        at = index[spec.name].offset + lo
        buf = _gather_window(segs, at, at + n, comm)
        return None if buf is None else buf.to(dtype)

    try:
        stream_shards(stage.path if rank0 else out, shards, fill, write=rank0, desc="save 16-bit model",
                      progress=rank0 and engine.show_progress)
        if rank0:
            _write_config(stage.path, _hf_config(engine.module), dtype)
            stage.publish()
    finally:
        if stage is not None:
            stage.discard()  # after a publish, nothing is left to remove
    comm.all_ok(True)
    return out if rank0 else None
