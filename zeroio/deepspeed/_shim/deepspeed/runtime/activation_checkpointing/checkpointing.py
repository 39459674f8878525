"""``deepspeed.checkpointing``: ``configure`` and ``checkpoint`` on torch's activation
checkpointing (zeroio/deepspeed/activation_checkpointing.py)."""

from zeroio.deepspeed.activation_checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["configure", "checkpoint", "is_configured", "reset", "non_reentrant_checkpoint"]
