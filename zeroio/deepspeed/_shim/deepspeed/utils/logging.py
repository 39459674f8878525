"""``deepspeed.utils.logging``: the ``DeepSpeed`` logger and ``log_dist``."""

from zeroio.deepspeed.logs import log_dist, logger, print_configuration, warning_once

__all__ = ["logger", "log_dist", "warning_once", "print_configuration"]
