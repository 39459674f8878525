"""``deepspeed.zero`` on zeroio: ``Init`` and ``GatheredParameters``."""

from __future__ import annotations

from zeroio.partition.zero import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters"]
