"""The shard types the partitioners build and the optimizers step: ``ShardGroup`` (this rank's
part of one optimizer param group), its ``Segment`` map, and ``ParamIndex`` (the global flat
order). ``zeroio.partition.base`` re-exports them with the ``Partitioner`` contract.

[Note: global flat order]
The global flat order is the parameters of ``model.named_parameters()``
(tied ones once), each flattened, concatenated, unpadded. ``ParamIndex``
records name -> (offset, shape) in it. Frozen parameters (not in any optimizer
param group) keep their place in the index but belong to no ShardGroup.

[Note: local layout]
A ShardGroup's local tensors (``master``, ``grad``) are 1-D and ``numel``
long (plus ``padded_numel - numel`` trailing padding a partitioner may use to
make every rank's shard equally long). Which global elements live where is
given only by ``segments``: sorted by ``local_offset``, disjoint, each a run of
``numel`` elements that are contiguous both locally and globally. A
partitioner may lay its shard out in any order (stage 2 uses bucket-wise
slices), so nothing may assume local offset == global offset - base.

[Note: bf16 shards]
With ``bf16.bf16_master_weights_and_grads`` the partitioners make ``master`` and ``grad`` bf16
(as DeepSpeed's master partition and averaged gradient partition then are): the masters start
as the parameters rounded to bf16 (the 16-bit parameters' own values); a reduced gradient is
averaged in fp32 and rounded once into the bf16 shard (its squared norm is taken from the
fp32 values before that rounding, as without the switch); a later micro step's gradient is
added into it in bf16, one rounding per sum, as DeepSpeed accumulates in the master dtype.
Where stage 1/2's 16-bit host gradients apply (partition/stage12.py, [Note: 16-bit host
gradients]) the shard holds the unaveraged reduced values, as without the switch. The
optimizer steps them in fp32 ([Note: bf16 optimizer state] in optim/adam.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A run of elements contiguous in this rank's shard and in the global flat order."""

    local_offset: int
    """Start inside the ShardGroup's local tensors."""
    global_offset: int
    """Start in the global flat order (see [Note: global flat order])."""
    numel: int


@dataclass(frozen=True, kw_only=True)
class ParamEntry:
    name: str
    offset: int
    """Start of this parameter in the global flat order."""
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True, kw_only=True)
class ParamIndex:
    """name -> (offset, shape) over the global flat order; identical on every rank."""

    entries: tuple[ParamEntry, ...]
    total_numel: int

    def by_name(self) -> dict[str, ParamEntry]:
        return {e.name: e for e in self.entries}

    def to_json(self) -> dict:
        return {
            "total_numel": self.total_numel,
            "params": {e.name: {"offset": e.offset, "shape": list(e.shape)} for e in self.entries},
        }

    @staticmethod
    def from_module(module: torch.nn.Module) -> ParamIndex:
        entries, offset = [], 0
        for name, p in module.named_parameters():  # named_parameters() drops tied duplicates
            entries.append(ParamEntry(name=name, offset=offset, shape=tuple(p.shape), numel=p.numel()))
            offset += p.numel()
        return ParamIndex(entries=tuple(entries), total_numel=offset)


@dataclass(eq=False, kw_only=True)
class ShardGroup:
    """This rank's part of one optimizer param group.

    ``master`` and ``grad`` are fp32 (bf16: [Note: bf16 shards]) and live where the optimizer
    steps them
    (GPU, pinned CPU). With NVMe offload the optimizer keeps ``master`` in the
    tiered store between steps and ``master`` here is the resident copy the
    optimizer hands back after the step (see ``zeroio/optim``).
    """

    group_index: int
    """Index of the optimizer param group whose hyperparameters apply."""
    master: torch.Tensor
    """fp32 (or bf16) master weights of this shard, 1-D, ``padded_numel`` long."""
    grad: torch.Tensor
    """fp32 gradient of this shard: reduced, averaged over ranks, summed over the accumulation
    micro steps and divided by their number. Valid after ``finalize_gradients(boundary=True)``.
    Exception: at stages 1/2 with the one-pass CPU Adam (optim/cpu_adam.py) and no host
    accumulation it is the 16-bit reduced gradient *not* divided by the world size; the
    optimizer's ``grad_divisor`` applies that (stage12.py, ``host_grad_dtype``)."""
    numel: int
    """Elements that belong to parameters (the rest of ``padded_numel`` is padding, kept zero)."""
    segments: tuple[Segment, ...]
    """Local offset -> global flat order map (see [Note: local layout])."""
    params: tuple[str, ...] = field(default=())
    """Names of the parameters with elements in this shard."""

    @property
    def padded_numel(self) -> int:
        return self.master.numel()

    def global_ranges(self) -> list[tuple[int, int]]:
        """(global_offset, numel) of every segment, in local order."""
        return [(s.global_offset, s.numel) for s in self.segments]


__all__ = ["ParamEntry", "ParamIndex", "Segment", "ShardGroup"]
