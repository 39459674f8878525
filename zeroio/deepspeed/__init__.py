"""``zeroio.deepspeed``: DeepSpeed's public Python API, served by zeroio.

A script written for DeepSpeed runs on zeroio with one line::

    import zeroio.deepspeed as deepspeed

and with no line changed under ``zeroio launch``, which puts a ``deepspeed``
package that forwards here on the script's import path (see ``shim_dir``).
Importing ``zeroio`` alone patches nothing.

Layout:
- ``api``: ``initialize``, ``add_config_arguments``, ``init_distributed``.
- ``zero``: ``Init`` (DeepSpeed's keyword arguments) and ``GatheredParameters``.
"""

from __future__ import annotations

from pathlib import Path

from zeroio.deepspeed import zero
from zeroio.deepspeed.api import add_config_arguments, init_distributed, initialize

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "shim_dir"]


def shim_dir() -> Path:
    """The folder that ``zeroio launch`` puts first on ``PYTHONPATH``: it holds a ``deepspeed``
    package forwarding to this module."""
    return Path(__file__).resolve().parent / "_shim"
