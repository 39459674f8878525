"""accelerate's DeepSpeed path on a host without GPUs: gloo instead of no backend.

[Note: DeepSpeed under accelerate without a GPU]
accelerate picks a process-group backend from the GPU it finds; on a host
without one it picks none and then counts a single process, even though
DeepSpeed's ``init_distributed`` (here: zeroio's) has joined every rank, so a
2-rank Trainer run fills ``train_batch_size`` for one rank and shards nothing.
With the facade active, a process that accelerate sets up for DeepSpeed
(``ACCELERATE_USE_DEEPSPEED=true``, launched with a ``LOCAL_RANK``) and for
which accelerate found no backend gets gloo with the process count of the
launched world, as ``--use_cpu`` runs have. GPU hosts are untouched (accelerate
finds its backend there). The patch goes on ``PartialState._prepare_backend``
when ``accelerate.state`` is imported (an import hook), or at once if it
already was.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from zeroio.config.launch_env import launch_env

_MODULE = "accelerate.state"


def _deepspeed_launch() -> bool:
    env = launch_env().variables
    return (env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
            and env.get("LOCAL_RANK") is not None)


def patch(state_module) -> None:
    cls = state_module.PartialState
    original = cls._prepare_backend
    if getattr(original, "_zeroio_gloo", False):
        return

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and not cpu and _deepspeed_launch():
            return "gloo", state_module.DistributedType.MULTI_CPU
        return found, kind

    _prepare_backend._zeroio_gloo = True
    cls._prepare_backend = _prepare_backend


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``accelerate.state`` through the other finders and patches it once executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        patch(module)


def install() -> None:
    """Patch accelerate now if imported, else when it is (idempotent)."""
    if _MODULE in sys.modules:
        patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
