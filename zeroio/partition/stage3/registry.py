"""Side tables from parameters to zeroio's own objects (nothing is stored on ``nn.Parameter``).

``INIT_SHARDS`` holds what ``zero.Init`` kept of each parameter it partitioned
(its true shape and this rank's slice of the flattened, padded parameter);
``OWNERS`` maps each parameter a stage-3 partitioner manages to that
partitioner. Both are weak on the parameter, so a dropped model frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(eq=False, kw_only=True)
class InitShard:
    """This rank's slice of a parameter created under ``zero.Init``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    shard: torch.Tensor
    """Elements ``[rank*S, (rank+1)*S)`` of the flattened parameter padded to ``S*world``."""
    world: int


INIT_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def true_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    rec = INIT_SHARDS.get(p)
    return rec.shape if rec is not None else tuple(p.shape)
