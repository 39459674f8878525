"""A checkpoint DeepSpeed wrote: which folder it is, which files it holds, where each value lies.

[Note: DeepSpeed's ZeRO layout] ``save_checkpoint(dir, tag)`` on DeepSpeed writes ``dir/latest``
(the tag, as text) and, in ``dir/<tag>/``:

- model states: ``mp_rank_00_model_states.pt`` (stages 1-2, rank 0 only) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per data-parallel rank (stage 3). A dict:
  ``module`` (the state_dict: full weights at stages 1-2, empty placeholders at stage 3, and
  the buffers named by ``buffer_names``), ``param_shapes`` (per flat group, the trainable
  parameters in the order of the flat fp32 buffer), ``frozen_param_shapes`` /
  ``frozen_param_fragments`` (parameters no optimizer owns: whole at stages 1-2, this rank's
  padded slice at stage 3), ``shared_params`` (tied name -> the name stored; rank 0's file
  only), ``lr_scheduler``, ``global_steps``, ``global_samples``, ``skipped_steps``,
  ``ds_config``, ``ds_version``, and the client state's keys at the top level.
- optimizer states: ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank, holding
  ``optimizer_state_dict`` with ``zero_stage``, ``partition_count``, ``loss_scaler``, and
  - stages 1-2: ``single_partition_of_fp32_groups`` (rank r's slice of each group's flat fp32
    buffer, its trailing padding removed: ``group_paddings``) and ``base_optimizer_state``
    (the torch optimizer's state_dict over those slices: moments padded, ``step``; or, saved
    with ``elastic_checkpoint``, a list of per-group states without padding). Group g's flat
    buffer is its parameters in ``param_shapes[g]`` order, each followed by
    ``param_alignment_paddings[g][i]`` elements, cut into equal slices, rank by rank.
  - stage 3: ``fp32_flat_groups`` (one per sub-group; ``param_shapes`` has one entry per
    sub-group) and ``optimizer_state_dict`` (the torch optimizer's, state per sub-group,
    param groups listing their sub-groups). In each sub-group, every parameter takes
    ceil(numel / world) elements on every rank: rank r holds its elements [r*k, (r+1)*k),
    the last rank zero-padded.

The files are pickles: they are read by `zeroio.io.torch_file` ([Note: restricted
unpickling]), which admits the plain DeepSpeed classes named in ``DS_RECORDS`` and nothing
else. Layouts zeroio does not serve (pipeline or tensor parallel, MoE, stage 0 and
bf16_zero, universal checkpoints, NVMe-swapped optimizer state) are refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroio.errors import CheckpointError
from zeroio.io.torch_file import Record, TensorRef, read_torch_file

#: The DeepSpeed classes whose objects its checkpoints hold, admitted as plain records.
DS_RECORDS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address": "fragment_address",
    "argparse.Namespace": "Namespace",
}
#: Keys of the model states file that are DeepSpeed's; the others are the client state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "num_experts", "ds_autoep_layers",
    "universal_checkpoint_info", "autoep_folding_metadata"})

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_MOE = re.compile(r"^(expp_rank_\d+_mp_rank_\d+_optim_states"
                  r"|(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states)\.pt$")


def is_deepspeed_tag(d: Path) -> bool:
    """``d`` holds DeepSpeed checkpoint files (of any layout)."""
    if not d.is_dir() or (d / "zarr.json").exists():
        return False
    return any(p.name.endswith(("_model_states.pt", "_optim_states.pt")) for p in d.iterdir())


def _refuse(d: Path, what: str, names: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{d} is a DeepSpeed checkpoint of a layout zeroio does not read: {what} (files "
        f"{names[:4]}). zeroio continues ZeRO stage 1-3 runs of plain data parallelism; convert it "
        "with DeepSpeed's zero_to_fp32.py and start from the weights (from_pretrained, or "
        "load_state_dict before zeroio.initialize)")


def classify(d: Path) -> tuple[dict[int, Path], dict[int, Path], bool]:
    """Rank -> model states file, rank -> optimizer file, whether the optimizer files are
    ``bf16_`` ones; any layout zeroio does not serve is a CheckpointError naming it."""
    names = sorted(p.name for p in d.iterdir())
    if (d / "zero").is_dir():
        raise _refuse(d, "a DeepSpeed universal checkpoint (ds_to_universal.py output)", ["zero/"])
    if (d / "offloaded_tensors").is_dir():
        raise _refuse(d, "optimizer state swapped to NVMe by DeepSpeed (offloaded_tensors/)",
                      ["offloaded_tensors/"])
    if pipe := [n for n in names if _PIPELINE.match(n)]:
        raise _refuse(d, "pipeline parallel (one model states file per layer)", pipe)
    if moe := [n for n in names if _MOE.match(n)]:
        raise _refuse(d, "mixture of experts (expert files)", moe)
    model, optim, bf16 = {}, {}, set()
    for n in names:
        if m := _MODEL.match(n):
            if int(m.group(2)):
                raise _refuse(d, f"tensor/model parallel (model-parallel rank {int(m.group(2))})", [n])
            model[int(m.group(1) or 0)] = d / n
        elif m := _OPTIM.match(n):
            if int(m.group(3)):
                raise _refuse(d, f"tensor/model parallel (model-parallel rank {int(m.group(3))})", [n])
            optim[int(m.group(2))] = d / n
            bf16.add(bool(m.group(1)))
    if not model:
        raise CheckpointError(f"{d} holds DeepSpeed optimizer files but no *_model_states.pt; the "
                              "save did not finish or the files were moved: restore them")
    if len(bf16) > 1:
        raise CheckpointError(f"{d} mixes bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files; "
                              "remove the ones another run left")
    return model, optim, bf16 == {True}


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Elements [param_lo, param_lo + n) of one parameter (flattened) lie at elements
    [flat_lo, flat_lo + n) of ``rank``'s flat buffer of ``group`` (stage 3: sub-group)."""

    param_lo: int
    n: int
    rank: int
    group: int
    flat_lo: int


def _shape(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(isinstance(d, int) for d in v):
        raise CheckpointError(f"{what}: shape {v!r} is not a tuple of integers")
    return tuple(v)


def _stage(optim_sd: dict, path: Path) -> int:
    z = optim_sd.get("zero_stage")
    if isinstance(z, Record) and z.args:
        z = z.args[0]
    if not isinstance(z, int) or z not in (1, 2, 3):
        raise CheckpointError(f"{path}: zero_stage is {z!r}; zeroio reads ZeRO stages 1, 2 and 3")
    return z


@dataclass(kw_only=True)
class DeepSpeedTag:
    """One tag of a DeepSpeed checkpoint, parsed (tensors not read) and mapped."""

    path: Path
    tag: str
    stage: int
    world_size: int
    bf16_files: bool
    model_states: dict[str, Any]  # rank 0's
    rank_model_states: dict[int, dict[str, Any]]  # stage 3: every rank's
    optim: list[dict[str, Any]]  # per rank: its optimizer_state_dict
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # trainable, flat order
    frozen: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # tied name -> stored name
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    group_of_flat: list[int] = field(default_factory=list)  # flat group -> param group

    @property
    def version(self) -> str:
        return str(self.model_states.get("ds_version", "?"))

    def flat(self, kind: str, rank: int, group: int) -> TensorRef:
        """``rank``'s flat buffer of ``kind`` ("fp32" or an optimizer state name) for ``group``."""
        osd = self.optim[rank]
        if kind == "fp32":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            ref = osd[key][group]
        else:
            ref = self.group_state(rank, group).get(kind)
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{self.path}: rank {rank} holds no {kind!r} tensor for flat group "
                                  f"{group}; it has {sorted(self.group_state(rank, group))}")
        return ref

    def group_state(self, rank: int, group: int) -> dict[str, Any]:
        """The torch optimizer's per-parameter state of ``rank``'s flat ``group``."""
        osd = self.optim[rank]
        if self.stage == 3:
            base = osd["optimizer_state_dict"]
        else:
            base = osd["base_optimizer_state"]
            if isinstance(base, list):  # elastic_checkpoint: one state per group, unpadded
                return base[group] if group < len(base) and isinstance(base[group], dict) else {}
        pid = base["param_groups"][self.group_of_flat[group]]["params"]
        key = group if self.stage == 3 else pid[0]
        state = base["state"].get(key, {})
        return state if isinstance(state, dict) else {}

    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups (hyperparameters), from rank 0."""
        osd = self.optim[0]
        base = osd["optimizer_state_dict"] if self.stage == 3 else osd["base_optimizer_state"]
        if isinstance(base, dict) and isinstance(base.get("param_groups"), list):
            return base["param_groups"]
        return [{} for _ in self.optim[0]["single_partition_of_fp32_groups"]]


def parse_tag(d: Path) -> DeepSpeedTag:
    """Read the pickles of tag folder ``d`` (tensors stay on disk) and map every parameter."""
    model_files, optim_files, bf16 = classify(d)
    states = {r: _read(p) for r, p in model_files.items()}
    ms = states.get(0)
    if ms is None:
        found = sorted(p.name for p in model_files.values())
        raise CheckpointError(f"{d}: no model states file of rank 0 (found {found})")
    if ms.get("optimizer") is not None:
        raise _refuse(d, "ZeRO stage 0 (the optimizer state is in the model states file)",
                      [p.name for p in model_files.values()])
    if not optim_files:
        raise CheckpointError(f"{d}: DeepSpeed's model states are here but its optimizer files "
                              "(*_optim_states.pt, one per rank) are missing; restore them")
    if (ms.get("mp_world_size") or 1) != 1:
        raise _refuse(d, f"tensor/model parallel (mp_world_size {ms['mp_world_size']})", [])
    if (ms.get("num_experts") or 1) not in (1, [1]):
        raise _refuse(d, f"mixture of experts (num_experts {ms['num_experts']})", [])
    optim = [_optimizer_dict(_read(optim_files[r]), optim_files[r]) for r in sorted(optim_files)]
    if sorted(optim_files) != list(range(len(optim_files))):
        raise CheckpointError(f"{d}: optimizer files of ranks {sorted(optim_files)}; ranks "
                              f"0..{len(optim_files) - 1} are needed: restore the missing ones")
    if any("zero_stage" not in o for o in optim) and bf16:
        raise _refuse(d, "bf16_zero (DeepSpeed's BF16_Optimizer, without ZeRO partitioning)",
                      [optim_files[0].name])
    stage = _stage(optim[0], optim_files[0])
    counts = optim[0].get("partition_count")
    world = max(counts) if isinstance(counts, list) else counts
    if world != len(optim):
        raise CheckpointError(f"{d}: the optimizer state was partitioned over {world} ranks, but "
                              f"{len(optim)} optimizer files are here; the save did not finish or "
                              "files are missing")
    if stage == 3 and sorted(states) != list(range(world)):
        raise CheckpointError(f"{d}: stage 3 needs the model states of every rank 0..{world - 1}; "
                              f"found ranks {sorted(states)}")
    tag = DeepSpeedTag(path=d, tag=d.name, stage=stage, world_size=world, bf16_files=bf16,
                       model_states=ms, rank_model_states=states, optim=optim)
    _map_params(tag)
    return tag


def _read(path: Path) -> dict[str, Any]:
    obj = read_torch_file(path, DS_RECORDS).obj
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not DeepSpeed's checkpoint dict")
    return obj


def _optimizer_dict(obj: dict, path: Path) -> dict[str, Any]:
    osd = obj.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise CheckpointError(f"{path} has no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file")
    return osd


def _map_params(tag: DeepSpeedTag) -> None:
    ms = tag.model_states
    groups = ms.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointError(f"{tag.path}: the model states have no param_shapes list; not a ZeRO checkpoint")
    shared = ms.get("shared_params") or {}
    tag.shared = {str(k): str(v) for k, v in shared.items()}
    frozen = ms.get("frozen_param_shapes") or {}
    tag.frozen = {str(n): _shape(s, f"{tag.path}: frozen {n}") for n, s in frozen.items()}
    if tag.stage == 3:
        _map_stage3(tag, groups)
    else:
        _map_stage12(tag, groups)


def _map_stage12(tag: DeepSpeedTag, groups: list[Mapping]) -> None:
    paddings = tag.optim[0].get("param_alignment_paddings")
    tag.group_of_flat = list(range(len(groups)))
    lean = [[_lean(tag, r, g) for g in range(len(groups))] for r in range(tag.world_size)]
    pads = [tag.optim[r].get("group_paddings") or [0] * len(groups) for r in range(tag.world_size)]
    for g, shapes in enumerate(groups):
        starts, at = [], 0  # where each rank's slice starts in the group's flat buffer
        for r in range(tag.world_size):
            starts.append(at)
            at += lean[r][g] + int(pads[r][g])
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            shape = _shape(shape, f"{tag.path}: {name}")
            numel = math.prod(shape)
            tag.shapes[str(name)] = shape
            lengths = [lean[r][g] for r in range(tag.world_size)]
            tag.pieces[str(name)] = _split(offset, numel, starts, lengths, g)
            offset += numel + (int(paddings[g][i]) if paddings else 0)
        if offset > sum(lean[r][g] for r in range(tag.world_size)):
            raise CheckpointError(f"{tag.path}: group {g}'s parameters need {offset} elements, its fp32 "
                                  f"slices hold {sum(lean[r][g] for r in range(tag.world_size))}; the "
                                  "checkpoint does not match its param_shapes")


def _lean(tag: DeepSpeedTag, rank: int, group: int) -> int:
    return tag.flat("fp32", rank, group).numel


def _split(offset: int, numel: int, starts: list[int], lengths: list[int], group: int) -> list[Piece]:
    """The pieces of a parameter at [offset, offset + numel) of a buffer cut into rank slices."""
    out = []
    for r, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        lo, hi = max(offset, s), min(offset + numel, s + n)
        if lo < hi:
            out.append(Piece(param_lo=lo - offset, n=hi - lo, rank=r, group=group, flat_lo=lo - s))
    return out


def _map_stage3(tag: DeepSpeedTag, groups: list[Mapping]) -> None:
    ws = tag.world_size
    param_groups = tag.optim[0]["optimizer_state_dict"].get("param_groups") or []
    owner = {j: g for g, pg in enumerate(param_groups) for j in pg.get("params", [])}
    tag.group_of_flat = [owner.get(j, 0) for j in range(len(groups))]
    for j, shapes in enumerate(groups):
        offset = 0
        for name, shape in shapes.items():
            shape = _shape(shape, f"{tag.path}: {name}")
            numel = math.prod(shape)
            k = -(-numel // ws)  # ceil: every rank's share, the last one padded
            tag.shapes[str(name)] = shape
            tag.pieces[str(name)] = [Piece(param_lo=r * k, n=min(numel, (r + 1) * k) - r * k, rank=r,
                                           group=j, flat_lo=offset) for r in range(ws) if r * k < numel]
            offset += k
        have = tag.flat("fp32", 0, j).numel
        if offset != have:
            raise CheckpointError(f"{tag.path}: sub-group {j}'s parameters take {offset} elements per "
                                  f"rank, its fp32 buffer holds {have}; the checkpoint does not match "
                                  "its param_shapes")


def frozen_pieces(tag: DeepSpeedTag, name: str) -> list[tuple[int, TensorRef, int, int]]:
    """(element of the parameter, tensor, its first element, n) runs of a frozen parameter's
    value: the whole fragment at stages 1-2, each rank's padded slice at stage 3."""
    numel = math.prod(tag.frozen[name])
    if tag.stage != 3:
        ref = (tag.model_states.get("frozen_param_fragments") or {}).get(name)
        if not isinstance(ref, TensorRef) or ref.numel != numel:
            raise CheckpointError(f"{tag.path}: frozen parameter {name!r} has no fragment of {numel} elements")
        return [(0, ref, 0, numel)]
    k = -(-numel // tag.world_size)
    out = []
    for r in range(tag.world_size):
        ref = (tag.rank_model_states[r].get("frozen_param_fragments") or {}).get(name)
        n = min(numel, (r + 1) * k) - r * k
        if n <= 0:
            continue
        if not isinstance(ref, TensorRef) or ref.numel < n:
            raise CheckpointError(f"{tag.path}: rank {r}'s fragment of frozen parameter {name!r} is missing")
        out.append((r * k, ref, 0, n))
    return out
