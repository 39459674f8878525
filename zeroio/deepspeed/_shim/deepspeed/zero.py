"""``deepspeed.zero``: ``Init``, ``GatheredParameters``, ``register_external_parameter``."""

from zeroio.deepspeed.facade import GatheredParameters, Init, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]
