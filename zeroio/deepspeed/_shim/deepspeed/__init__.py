"""``deepspeed`` on zeroio: DeepSpeed's Python API, served by zeroio (not DeepSpeed).

Found first on the import path under ``zeroio launch`` and after the one
import line (``import zeroio.deepspeed`` / ``zeroio.integrations.transformers``);
see zeroio/deepspeed/facade.py. Every module here forwards to zeroio.
"""

from zeroio.deepspeed import facade as _facade
from zeroio.deepspeed.version import FOLLOWS as __version__

_facade.install_parameter_attributes()

from deepspeed import accelerator, checkpoint, comm, ops, runtime, utils, zero  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from zeroio.deepspeed.api import add_config_arguments  # noqa: E402
from zeroio.deepspeed.facade import init_distributed, initialize  # noqa: E402

__git_hash__ = "zeroio"
__git_branch__ = "zeroio"

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "comm", "runtime",
           "utils", "accelerator", "ops", "checkpoint", "DeepSpeedEngine", "__version__"]
