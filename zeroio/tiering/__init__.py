"""Tiered storage manager: GPU / pinned CPU / NVMe tiers, prefetch, eviction policies, stats.

``TieredStore`` is the one class the partitioner and optimizer use; see
docs/tiering.md for the config keys and docs/internals.md for the contract.
"""

from zeroio.config.policy import TieringPolicy
from zeroio.tiering.backend import MemoryBackend, NvmeBackend
from zeroio.tiering.config import STORE_READ_AHEAD, Budgets, home_for, store_policy
from zeroio.tiering.policy import (
    EvictionPolicy,
    FIFOPolicy,
    LRUPolicy,
    PolicyKind,
    TracePolicy,
    make_policy,
)
from zeroio.tiering.store import TieredStore
from zeroio.tiering.tier import Residency, Tier

__all__ = [
    "TieredStore",
    "Tier",
    "Residency",
    "TieringPolicy",
    "store_policy",
    "STORE_READ_AHEAD",
    "Budgets",
    "home_for",
    "PolicyKind",
    "EvictionPolicy",
    "LRUPolicy",
    "FIFOPolicy",
    "TracePolicy",
    "make_policy",
    "NvmeBackend",
    "MemoryBackend",
]
