"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` read by zeroio's config layer."""

from zeroio.deepspeed.runtime_config import DeepSpeedConfig, DeepSpeedConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
