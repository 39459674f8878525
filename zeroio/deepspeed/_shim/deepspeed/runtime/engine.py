"""``deepspeed.runtime.engine.DeepSpeedEngine``: the adapter ``deepspeed.initialize`` returns."""

from zeroio.deepspeed.engine_adapter import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
