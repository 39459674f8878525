"""Run at interpreter start where ``zeroio launch`` puts the facade on ``PYTHONPATH``.

Hooks accelerate's DeepSpeed set-up for hosts without a GPU (see [Note: DeepSpeed under
accelerate without a GPU] in zeroio/deepspeed/cpu_backend.py), then runs the
``sitecustomize`` this one shadows, if the environment has one.
"""

import importlib.util
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent


def _chain() -> None:
    for entry in sys.path:
        try:
            if Path(entry or ".").resolve() == _here:
                continue
        except OSError:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


try:
    from zeroio.deepspeed import cpu_backend

    cpu_backend.install()
finally:
    _chain()
