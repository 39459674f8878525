"""``zeroio.deepspeed``: DeepSpeed's public API, served by zeroio.

A script written for DeepSpeed runs on zeroio with one line::

    import zeroio.deepspeed as deepspeed

and with no line changed under ``zeroio launch``, which puts a ``deepspeed``
package that forwards here on the script's import path (see ``shim_dir``).
Importing this package also makes a plain ``import deepspeed`` (in
transformers, accelerate, TRL) give that facade in this process, unless a real
DeepSpeed is installed (see [Note: activating the facade] in facade.py).
Importing ``zeroio`` alone patches nothing.

Layout:
- ``api``: ``add_config_arguments``, ``init_distributed``, and the engine build under
  ``initialize`` (``facade.initialize``: every route returns the same ``DeepSpeedEngine``).
- ``zero``: ``Init`` (DeepSpeed's keyword arguments) and ``GatheredParameters``.
- ``facade``: activation, and the functions the ``_shim/deepspeed`` modules forward to.
- ``engine_adapter``: the ``DeepSpeedEngine`` that transformers/accelerate/TRL call.
- ``params``: the ``ds_*`` parameter attributes transformers and TRL read.
- ``engine_queries``: DeepSpeed's config getters on that engine; ``client_state``: the JSON
  form of ``save_checkpoint``'s ``client_state``.
- ``ranks``, ``comm_api``: ``deepspeed.comm`` (getters, collectives) and ``accelerator``.
- ``optimizers``, ``base_optimizer``: ``deepspeed.ops``' optimizer classes, ``DeepSpeedOptimizer``.
- ``runtime_config``: ``DeepSpeedConfig``; ``logs``: ``deepspeed.utils.logging``,
  ``see_memory_usage``; ``activation_checkpointing``: ``deepspeed.checkpointing``.
- ``accessors``: ``safe_get_full_fp32_param`` and the other full-parameter accessors;
  ``zero_to_fp32``: its three functions; ``estimators``: the ZeRO-2/3 memory estimators.
- ``state_dict``: consolidated state dicts; ``unsupported``: the names zeroio does not serve.
"""

from __future__ import annotations

from zeroio.deepspeed import zero
from zeroio.deepspeed.api import add_config_arguments, init_distributed
from zeroio.deepspeed.engine_adapter import DeepSpeedEngine
from zeroio.deepspeed.facade import initialize, install, shim_dir
from zeroio.deepspeed.version import FOLLOWS as __version__

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "DeepSpeedEngine",
           "shim_dir", "install", "__version__"]

install()
