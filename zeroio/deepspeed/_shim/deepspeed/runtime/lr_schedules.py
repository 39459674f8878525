"""``deepspeed.runtime.lr_schedules``: zeroio's schedules under DeepSpeed's names."""

from zeroio.optim.lr_schedules import WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""DeepSpeed's list (accelerate checks a scheduler's class name against it); zeroio
implements WarmupLR and WarmupDecayLR, the config layer refuses the others by name."""

__all__ = ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR"]
