"""Pre-flight disk check of `zeroio train`: everything the run will write under --output, before it trains.

[Note: what the run writes] Checkpoints are never replaced: every
``--save-every`` multiple and the final step get their own tag
(``checkpoints/stepN``). Without --keep-last all of them are on disk together
when the final model is exported; with --keep-last N (``checkpoint.keep_last``)
the newest N are, and N + 1 while a save is written, since the oldest goes only
once the new tag is committed ([Note: keeping the newest N] in
zeroio/checkpoint/retention.py). Before the export the run closes the optimizer, which
deletes the moments' swap files (the export reads the fp32 masters, which live
in host or GPU memory, never in the optimizer's swap). The peak is therefore
the larger of the two phases:

    training:  kept x checkpoint (+ 1 being saved)  +  NVMe swap files (same file system)
    export:    kept x checkpoint  +  model export  +  NVMe swap files but the moments

- checkpoint: the writer's own count (``writer.checkpoint_bytes``): the arrays
  ``engine_io.build_state`` writes (fp32 masters, exp_avg, exp_avg_sq; no
  16-bit array), whole chunks, the last one padded;
- model export: the safetensors files exactly (headers from
  ``consolidate.safetensors_header``, the same shard plan) in --model-dtype;
- NVMe swap: ``zeroio.estimate``'s NVMe term for this config and world (the
  two moments with offload_optimizer nvme; the 16-bit parameter shard with
  offload_param nvme unless params_from_master drops it, which "auto" does with
  the NVMe optimizer; only the shard stays through the export). An upper bound:
  what stays resident in host memory is never written, but the tier may write
  all of it. Not counted: the few persistent parameters (below
  stage3_param_persistence_threshold) that keep a 16-bit NVMe home under
  params_from_master, kilobytes to a few MB.
What the run deletes before writing counts as free: what zeroio wrote in model/
(replaced by the export) and, on a fresh run, in checkpoints/ ([Note: run
directory] in rundir.py; with --overwrite those folders whole, nvme/ too), and
crashed runs' swap folders under the NVMe paths ([Note: swap folders] in
zeroio/io/swapdir.py).
JSON metadata (manifests, config.json) is kilobytes and not counted.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroio.checkpoint.writer import existing_parent, tree_bytes
from zeroio.errors import CapacityError, CheckpointError

MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class DiskItem:
    """One kind of file the run writes, and how many of it are on disk at the peak."""

    name: str
    nbytes: int
    count: int = 1
    phases: tuple[str, ...] = ("train", "export")
    """The phases of the run it is on disk in ([Note: what the run writes])."""

    @property
    def total(self) -> int:
        return self.nbytes * self.count


@dataclass(frozen=True, kw_only=True)
class DiskPlan:
    """The bytes a run writes under its output folder against that file system's free bytes."""

    output: Path
    items: tuple[DiskItem, ...]
    free: int
    """Free bytes of the file system now, plus what the run deletes before writing."""

    def phase_bytes(self, phase: str) -> int:
        return sum(i.total for i in self.items if phase in i.phases)

    @property
    def need(self) -> int:
        """The peak: the larger phase ([Note: what the run writes])."""
        return max(self.phase_bytes("train"), self.phase_bytes("export"))

    @property
    def fits(self) -> bool:
        return self.need <= self.free

    def breakdown(self) -> str:
        exports = any(i.phases == ("export",) for i in self.items if i.total)

        def one(i: DiskItem) -> str:
            return (f"{i.name} {i.total / 1e9:.2f} GB"
                    + (f" ({i.count} x {i.nbytes / 1e9:.2f})" if i.count > 1 else "")
                    + (", deleted before the model export"
                       if exports and "export" not in i.phases else ""))

        text = "; ".join(one(i) for i in self.items if i.total)
        train, export = self.phase_bytes("train"), self.phase_bytes("export")
        if exports and train != export:
            text += (f"; peak of training {train / 1e9:.2f} GB and export "
                     f"{export / 1e9:.2f} GB")
        return text


def param_specs(mcfg, dtype: torch.dtype):
    """The model's parameters as ``TensorSpec``s, from a build on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from zeroio.checkpoint.consolidate import TensorSpec

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mcfg)
    return [TensorSpec(name=n, shape=tuple(p.shape), dtype=dtype) for n, p in model.named_parameters()]


def export_bytes(specs) -> int:
    """Bytes of the safetensors files the export writes for ``specs`` (headers included)."""
    from zeroio.checkpoint.consolidate import (
        DEFAULT_MAX_SHARD_BYTES,
        plan_shards,
        safetensors_header,
    )

    return sum(len(safetensors_header(shard, {"format": "pt"})[0]) + sum(s.nbytes for s in shard)
               for shard in plan_shards(specs, DEFAULT_MAX_SHARD_BYTES))


def training_checkpoint_bytes(numel: int) -> int:
    """One training checkpoint: the arrays ``engine_io.build_state`` writes, as the writer counts them."""
    from zeroio.checkpoint.engine_io import OPTIMIZER_KINDS
    from zeroio.checkpoint.writer import checkpoint_bytes

    return checkpoint_bytes(numel, {k: torch.float32 for k in ("fp32", *OPTIMIZER_KINDS)})


def num_saves(start: int, end: int, save_every: int) -> int:
    """Checkpoints a run from ``start`` to ``end`` writes: each ``save_every`` multiple, and the end."""
    if save_every < 0:
        raise ValueError(f"save_every must be >= 0 (0: only at the end), got {save_every}")
    if end <= start:
        return 0
    every = (end // save_every - start // save_every) if save_every else 0
    return every + (0 if save_every and end % save_every == 0 else 1)


def nvme_paths(cfg, out: Path) -> list[Path]:
    """The config's NVMe swap folders that lie on the file system of ``out``."""
    zo = cfg.zero_optimization
    dev = os.stat(existing_parent(out)).st_dev
    paths = {Path(b.nvme_path) for b in (zo.offload_param, zo.offload_optimizer)
             if b.device.value == "nvme" and b.nvme_path}
    return sorted(p for p in paths if os.stat(existing_parent(p)).st_dev == dev)


def nvme_bytes(cfg, numel: int, world_size: int) -> int:
    """NVMe swap bytes of this node's ranks for ``cfg`` (zeroio.estimate's NVMe term)."""
    return sum(nvme_split(cfg, numel, world_size))


def nvme_split(cfg, numel: int, world_size: int) -> tuple[int, int]:
    """(optimizer moments, the rest: parameter shards) of `nvme_bytes`."""
    from zeroio.config.launch_env import launch_env
    from zeroio.estimate import estimate_memory

    local = launch_env().local_world_size or world_size
    est = estimate_memory(numel, gpus_per_node=local, nodes=max(1, world_size // local), config=cfg)
    moments = sum(i.bytes_per_gpu for i in est.items
                  if i.tier == "nvme" and i.name == "optimizer moments") * local
    return moments, est.nvme_bytes_per_node - moments


def checkpoint_items(one: int, saves: int, keep_last: int | None) -> list[DiskItem]:
    """The run's checkpoints on disk at the peak: all ``saves`` of ``one`` byte each, or with
    ``keep_last`` the newest N, plus the one being saved in training ([Note: what the run
    writes])."""
    kept = saves if keep_last is None else min(saves, keep_last)
    items = [DiskItem(name="checkpoints", nbytes=one, count=kept)]
    if saves > kept:
        items.append(DiskItem(name="checkpoint being saved (--keep-last removes the oldest "
                                   "after it)", nbytes=one, phases=("train",)))
    return items


def plan(*, out: Path, mcfg, cfg, world_size: int, start: int, end: int, save_every: int,
         checkpoint: bool, write_model: bool, model_dtype: str, fresh: bool,
         overwrite: bool = False, keep_last: int | None = None) -> DiskPlan:
    """What a run writes under ``out``, and the free bytes it has for it ([Note: what the run
    writes]); ``keep_last``: checkpoint.keep_last (None: every checkpoint stays)."""
    specs = param_specs(mcfg, MODEL_DTYPES[model_dtype])
    numel = sum(s.numel for s in specs)
    items = []
    if checkpoint:
        items += checkpoint_items(training_checkpoint_bytes(numel),
                                  num_saves(start, end, save_every), keep_last)
    if write_model:
        items.append(DiskItem(name=f"model ({model_dtype})", nbytes=export_bytes(specs),
                              phases=("export",)))
    swap = nvme_paths(cfg, out)
    if swap:
        moments, rest = nvme_split(cfg, numel, world_size)
        items.append(DiskItem(name="NVMe swap (optimizer moments)", nbytes=moments,
                              phases=("train",)))
        items.append(DiskItem(name="NVMe swap (parameters)", nbytes=rest))
    from zeroio.cli.train.rundir import removable_bytes
    from zeroio.io.swapdir import find_stale

    parts = ("model", "checkpoints", "nvme") if fresh else ("model",)
    freed = removable_bytes(out, parts, overwrite=overwrite)
    if not (fresh and overwrite):
        freed += sum(tree_bytes(d) for p in swap for d in find_stale(p))
    return DiskPlan(output=out, items=tuple(items),
                    free=shutil.disk_usage(existing_parent(out)).free + freed)


def check(p: DiskPlan, *, checkpoint: bool, model_dtype: str) -> None:
    """CheckpointError naming the output folder, bytes needed vs free and the fixes, unless it fits."""
    if p.fits:
        return
    fixes = ["--output on a file system with more room"]
    if any(i.name == "checkpoints" and i.count > 1 for i in p.items):
        fixes.append("a smaller --keep-last N (only the newest N checkpoints stay)")
    if checkpoint:
        fixes.append("--no-checkpoint (only the final model is written, from the live engine)")
    if model_dtype != "bf16":
        fixes.append("--model-dtype bf16 (half the model's bytes)")
    if any(i.name.startswith("NVMe swap") and i.total for i in p.items):
        fixes.append("a --config whose nvme_path lies on another file system")
    raise CheckpointError(
        f"--output {p.output} needs {p.need:,} bytes ({p.need / 1e9:.2f} GB: {p.breakdown()}) but "
        f"its file system has {p.free:,} bytes ({p.free / 1e9:.2f} GB) free; nothing was trained or "
        f"written. Fix: {'; or '.join(fixes)}")


def check_nvme_reserve(cfg, *, numel: int, world_size: int) -> None:
    """CapacityError naming the path, its free bytes, the reserve and its key, unless every
    file system holding an ``nvme_path`` keeps room for the swap after the reserve.

    With ``nvme_budget_bytes`` unset the tiered store's NVMe budget is the free space minus
    ``zero_optimization.tiering.nvme_reserve_bytes`` (docs/tiering.md); a file system below
    the reserve would otherwise fail only at the first ``register``, as if no nvme_path were
    set. The swap bytes are zeroio.estimate's NVMe term, the upper bound ``plan`` counts too.
    """
    zo = cfg.zero_optimization
    if zo.tiering.nvme_budget_bytes is not None:
        return
    paths = sorted({Path(b.nvme_path) for b in (zo.offload_param, zo.offload_optimizer)
                    if b.device.value == "nvme" and b.nvme_path})
    if not paths:
        return
    need = nvme_bytes(cfg, numel, world_size)
    reserve = zo.tiering.nvme_reserve_bytes
    for path in paths:
        free = shutil.disk_usage(existing_parent(path)).free
        if free - reserve >= need:
            continue
        raise CapacityError(
            f"NVMe swap under {path}: its file system has {free:,} bytes free and "
            f"zero_optimization.tiering.nvme_reserve_bytes keeps {reserve:,} of them free, which "
            f"leaves {max(0, free - reserve):,} bytes for up to {need:,} bytes of swap; nothing was "
            "trained or written. Fix: free space there; or point nvme_path at a file system with "
            "room; or lower zero_optimization.tiering.nvme_reserve_bytes in --config")
