"""``deepspeed`` on zeroio: DeepSpeed's Python API, served by zeroio (not DeepSpeed).

Found first on the import path under ``zeroio launch`` and after the one
import line (``import zeroio.deepspeed`` / ``zeroio.integrations.transformers``);
see zeroio/deepspeed/facade.py. Every module here forwards to zeroio; a DeepSpeed name
zeroio does not serve fails with a line saying what zeroio offers instead
(zeroio/deepspeed/unsupported.py).
"""

from zeroio.deepspeed import facade as _facade
from zeroio.deepspeed import unsupported as _unsupported
from zeroio.deepspeed.version import FOLLOWS as __version__

_facade.install_parameter_attributes()
_unsupported.install_finder()

from deepspeed import accelerator, checkpoint, comm, ops, runtime, utils, zero  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import log_dist, logger  # noqa: E402
from zeroio.deepspeed.api import add_config_arguments  # noqa: E402
from zeroio.deepspeed.facade import init_distributed, initialize  # noqa: E402

__git_hash__ = "zeroio"
__git_branch__ = "zeroio"
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in __version__.split("."))

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "comm", "runtime",
           "utils", "accelerator", "ops", "checkpoint", "checkpointing", "DeepSpeedEngine",
           "DeepSpeedConfig", "DeepSpeedConfigError", "log_dist", "logger", "__version__"]


def __getattr__(name: str):
    raise _unsupported.attribute_error(name)
