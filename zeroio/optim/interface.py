"""What the engine asks of every optimizer it builds (``ShardedAdam``, ``SwappedAdam``,
``TwinAdam``) beyond ``step`` and ``param_groups``, with the defaults an optimizer that lacks
a capability inherits, so the engine never probes with getattr/hasattr."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import MappingProxyType

import torch


class EngineOptimizer:
    """The engine-facing surface of a zeroio optimizer."""

    rule_name: str = "adam"
    """The update rule (``optimizer.type`` lower-cased; Adam and AdamW are both "adam"), which a
    checkpoint records so that one rule's state is never loaded into another's."""
    state_kinds: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    """The per-element state arrays besides the fp32 masters (a checkpoint's kinds)."""
    store: object | None = None
    """The tiered store holding this optimizer's state (NVMe moments), whose counters
    ``engine.stats()`` reports; None where the state is plain tensors (``held_tensors``)."""
    chunked_step: bool = False
    """Whether ``begin_chunked_step`` is available (host masters stepped chunk by chunk by
    the partitioner's ``run_step``)."""

    @property
    def state(self) -> Mapping:
        """torch's ``Optimizer.state`` for clients that walk it (Lightning's teardown moves each
        entry's tensors to the CPU): empty. zeroio keeps its state per ShardGroup, flat and
        perhaps off-host (``group_states`` where it is in memory; ``local_tensor`` /
        ``read_local`` for every kind), not per parameter."""
        return MappingProxyType({})

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict()`` shape for clients that call it (Lightning's
        checkpoint dump; DeepSpeed's strategies then drop it): each group's hyperparameters
        (``params`` as positions, as torch), and no ``state``: masters and moments are saved
        by ``engine.save_checkpoint``, sharded."""
        groups, first = [], 0
        for group in self.param_groups:
            n = len(group.get("params", ()))
            hyper = {k: v for k, v in group.items() if k != "params" and not callable(v)}
            groups.append({**hyper, "params": list(range(first, first + n))})
            first += n
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The hyperparameters of ``state_dict()``'s groups back into ``param_groups``; state
        (moments) comes from ``engine.load_checkpoint`` only."""
        if state_dict.get("state"):
            raise ValueError("load_state_dict: zeroio's optimizer state (masters, moments) is "
                             "loaded by engine.load_checkpoint from a checkpoint "
                             "engine.save_checkpoint wrote, not from a state dict")
        saved = state_dict.get("param_groups", [])
        if len(saved) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(saved)} param groups, the optimizer has "
                             f"{len(self.param_groups)}")
        for live, old in zip(self.param_groups, saved, strict=True):
            live.update({k: v for k, v in old.items() if k != "params"})

    reads_ranges: bool = False
    """Whether ``read_local`` / ``write_local_range`` exist: state kept off-host or split
    (NVMe moments, a ratio-split group), which a checkpoint reads and writes piece by piece
    instead of as one local tensor."""

    def read_local(self, group_index: int, kind: str, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of the group's local ``kind`` tensor as a host tensor
        (``reads_ranges``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its state as local tensors")

    def write_local_range(self, group_index: int, kind: str, lo: int,
                          values: torch.Tensor) -> None:
        """Overwrite elements [lo, lo + len(values)) of the group's ``kind`` (``reads_ranges``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its state as local tensors")

    def replacing(self, kinds: tuple[str, ...]) -> contextlib.AbstractContextManager:
        """Around a checkpoint load that writes every element of ``kinds``: state kept in
        pieces may replace each piece whole instead of reading it first ([Note: a load
        replaces pieces whole] in optim/swap_state.py); default: nothing to do."""
        return contextlib.nullcontext()

    def write_local(self, group_index: int, kind: str, values: torch.Tensor) -> None:
        """Hand a whole local ``kind`` tensor back after a checkpoint load (state kept as a
        copy must be written back); default: the local tensors were the state itself."""

    def flush_swap(self) -> int:
        """Write every dirty piece of NVMe-resident state to its swap files and wait, so that
        ``swap_files`` hold the latest bytes; returns the bytes written. Default: none."""
        return 0

    def swap_files(self, group_index: int, kind: str) -> list[tuple[str, int, int, int, int]] | None:
        """The swap files holding the group's local ``kind`` state after ``flush_swap``:
        (path, first local element, elements, file bytes, crc offset) each, which a
        checkpoint may share instead of copying; None (default) when the state is not in
        files."""
        return None

    def begin_chunked_step(self, grad_scale: float = 1.0):
        """A ``ChunkedStep`` (optim/adam.py) for the partitioner to run (``chunked_step``)."""
        raise NotImplementedError(f"{type(self).__name__} has no chunked step")

    def held_tensors(self) -> list[torch.Tensor]:
        """State kept in memory outside any tiered store ([Note: tiers outside stores] in
        tiering/stats.py); default: none."""
        return []

    def swap_plan(self) -> dict | None:
        """How NVMe-resident state uses its host share (``engine.stats()["sources"]
        ["optimizer"]["swap_plan"]``): pieces, resident head, read-ahead, bytes streamed each
        way per step; None (default) without NVMe state."""
        return None

    def drain(self) -> None:
        """Finish background work on the state (NVMe write-behind); default: none."""

    def close(self) -> None:
        """Release stores and files; default: nothing to release."""


__all__ = ["EngineOptimizer"]
