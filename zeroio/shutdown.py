"""Leave cleanly at interpreter exit: every live engine closed, zeroio's process groups gone.

[Note: a clean exit]
A run that finished its work used to end with ``terminate called without an active
exception`` and SIGABRT (exit 134). The cause: the engine's daemon threads (the overlapped
host step, ``zero_optimization.tiering.overlap_step``, still running CPU Adam and
publication after the last ``engine.step()`` returned; the tiering store's prefetch worker)
were inside torch's C++ code when the interpreter finalized. Python ends such a thread with
``pthread_exit`` as soon as it tries to take the GIL back; the forced unwind runs through C++
frames that may not unwind, and the C++ runtime calls ``std::terminate``. It depends on timing
only (how long the last host step takes), so it hit 1 run in several, with any launcher.

So the first engine made registers one ``atexit`` hook (atexit hooks run before daemon threads
are stopped) that, on a normal exit: closes every engine still open (joins its host step,
stops its workers, removes its swap folders: ``Engine.close``), then leaves the process groups
(``collectives.release_at_exit``): zeroio's side groups and the world, whoever made it.

The world goes too because a gloo worker thread can still hold the last reference to a
finished collective after the thread that waited on it moved on (the overlapped host step's
last all-gather, waited on by ``close``); dropping it frees tensors' Python objects, which
takes the GIL, and during finalization that ends the worker with the same forced unwind
through C++ frames. Leaving the world joins its workers with the GIL released where nothing
else holds the group; where something does (a prepared model still alive, whose hooks keep
it), the hook then waits a moment with the GIL released so that such a worker finishes
before finalization (``collectives.release_at_exit``). It hit the Trainer's route (whose
world accelerate makes, so zeroio used to leave it joined) in about 1 run in 6, and
accelerate's config-file route, under load, in about 1 run in 25. At exit no code of the script is left to use
the world (only atexit hooks registered before the first engine, which run after this one).
On an exit by an uncaught exception the engines are left as they are: a host step blocked in
a collective with a rank that died would hold the exit for the whole collective timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref

from zeroio.partition import collectives as comm

_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Engine -> the pid that built it: a forked child never closes (and removes the swap folders
of) its parent's engines."""
_REGISTERED = False
_OWNER_PID: list[int] = []
"""The pid that registered the hook: a forked child leaves its parent's groups alone (closing
its copies of gloo's sockets would shut the parent's connections)."""


def track(engine) -> None:
    """Close ``engine`` at exit if it is still open then ([Note: a clean exit])."""
    global _REGISTERED
    _ENGINES[engine] = os.getpid()
    if not _REGISTERED:
        atexit.register(_at_exit)
        _OWNER_PID[:] = [os.getpid()]
        _REGISTERED = True


def _failed_exit() -> bool:
    """Whether the interpreter is exiting on an uncaught exception (it recorded it)."""
    return getattr(sys, "last_value", None) is not None


def close_all() -> None:
    """Close every engine still open (each one's errors are swallowed: the process is ending)."""
    for engine, pid in list(_ENGINES.items()):
        if pid != os.getpid():
            continue
        with contextlib.suppress(BaseException):
            engine.close()


def _at_exit() -> None:
    if _failed_exit():
        return
    close_all()
    if _OWNER_PID != [os.getpid()]:
        return
    with contextlib.suppress(BaseException):
        comm.release_at_exit()


__all__ = ["close_all", "track"]
