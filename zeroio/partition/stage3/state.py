"""States of a stage-3 parameter group and of the whole partitioner, as enums.

[Note: group state machine]
A group's full parameters are either absent (SHARDED: every ``nn.Parameter``
of the group holds an empty placeholder), being assembled (GATHERING: an
all-gather into a fresh contiguous buffer is in flight, the handle is kept on
the group), or present (GATHERED: every parameter's ``.data`` is a view into
that buffer). Only these transitions exist:

    SHARDED  -> GATHERING   start_gather()   (hook, prefetch, GatheredParameters)
    GATHERING -> GATHERED   finish_gather()  (waits on the collective's handle)
    GATHERED -> SHARDED     release()        (no holds left, not persistent)

Persistent groups (parameters under ``stage3_param_persistence_threshold``)
go SHARDED -> GATHERING -> GATHERED once and stay; after an optimizer step
they are re-gathered in place by ``republish``.
"""

from __future__ import annotations

import enum

from zeroio.errors import DistributedError


class GroupState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


_ALLOWED = {
    (GroupState.SHARDED, GroupState.GATHERING),
    (GroupState.GATHERING, GroupState.GATHERED),
    (GroupState.GATHERED, GroupState.SHARDED),
}


def check_transition(name: str, old: GroupState, new: GroupState) -> None:
    """Raise if ``old -> new`` is not one of the named transitions of the note above."""
    if (old, new) not in _ALLOWED:
        raise DistributedError(
            f"stage 3 group {name!r}: illegal state change {old.value} -> {new.value} "
            "(see [Note: group state machine] in zeroio/partition/stage3/state.py)"
        )


class PassState(enum.Enum):
    """Which pass the model is in; decides whether a forward post-hook may release."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"   # includes forwards recomputed by activation checkpointing
