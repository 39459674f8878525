"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters``, ``partition_parameters``."""

from deepspeed.runtime.zero import partition_parameters
from zeroio.deepspeed.facade import GatheredParameters, Init, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "partition_parameters"]
