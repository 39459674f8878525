"""Progress bars of long library operations (initialize's writes to NVMe), and their one switch.

Long commands show progress (DESIGN.md); inside ``zeroio.initialize`` there is no command
line to carry ``--quiet``, so the callers that have one say it here: ``zeroio train --quiet``
/ ``--json``, the Trainer's ``disable_tqdm`` and the benchmarks' ``--quiet`` run
``initialize`` under ``quiet()``. A bar is shown only where its owner asks (rank 0) and no
``quiet()`` is active in this thread of control (a context variable).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from tqdm import tqdm

_QUIET = contextvars.ContextVar("zeroio_progress_quiet", default=False)


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No bars inside (with ``on``; ``quiet(False)`` changes nothing)."""
    token = _QUIET.set(_QUIET.get() or bool(on))
    try:
        yield
    finally:
        _QUIET.reset(token)


def enabled() -> bool:
    """Whether a bar would show now (no ``quiet()`` active)."""
    return not _QUIET.get()


def bar(*, total: int, desc: str, unit: str = "B", show: bool = True) -> tqdm:
    """A tqdm bar, disabled unless ``show`` and ``enabled()``; bytes scale to kB/MB/GB. It
    appears once the operation has taken 2 s (a short initialize prints nothing)."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B",
                disable=not (show and enabled()), leave=False, mininterval=1.0, delay=2.0)


__all__ = ["bar", "enabled", "quiet"]
