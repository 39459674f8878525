"""``deepspeed.launcher``: use ``zeroio launch`` (same flags)."""
