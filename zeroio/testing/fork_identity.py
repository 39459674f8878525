"""Is a rank forked from the preloaded server the process a spawned rank would be?

A spawned rank starts from this process's environment now, with this process's interpreter
and flags, and imports its code through this process's ``sys.path`` now, from the files as
they are now. A rank forked from the server inherits what the server had when it started:
its start environment, its interpreter, and every module it preloaded, found through *its*
``sys.path`` (Python 3.11's forkserver ignores the ``sys_path`` it is handed) and read from
disk when it started. ``differences`` lists, in the forked rank, everything that tells the
two apart; any entry means the job must be spawned. The checks run before the rank does
anything and take some tens of milliseconds.

``LOADED`` is taken when this module is imported: in the server, where it is preloaded last,
it records every module file the server loaded, with its size and modification time.
"""

from __future__ import annotations

import os
import sys

PROC_ENVIRON = "/proc/self/environ"

VOLATILE = (
    # set by pytest in this process for each test phase
    "PYTEST_CURRENT_TEST",
    # set in-process by torch's inductor on its first compile (its cache folder) and before it
    # loads each compiled module (a pointer that module reads through getenv as it loads);
    # never read at process start or at import
    "TORCHINDUCTOR_CACHE_DIR",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
)
"""Variables that may differ between the server's start environment and the parent's: a
forked rank's ``os.environ`` is set to the parent's exactly, and nothing reads them earlier."""


def start_environ(path: str = PROC_ENVIRON) -> dict[str, str] | None:
    """The environment a process started with (None where ``path`` is not readable)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
    return {k.decode(errors="surrogateescape"): v.decode(errors="surrogateescape")
            for k, v in pairs}


def process_environ() -> dict[str, str] | None:
    """This process's C-level environment now: what a child started now inherits. It can hold
    more than ``os.environ`` (a C library may ``setenv``, as readline does ``LINES``)."""
    try:
        import ctypes

        env = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, AttributeError):
        return None
    out, i = {}, 0
    while env[i] is not None:
        k, sep, v = env[i].decode(errors="surrogateescape").partition("=")
        if sep:
            out[k] = v
        i += 1
    return out


def environ_differences(start: dict[str, str] | None, parent: dict[str, str]) -> list[str]:
    """Names of the variables (``VOLATILE`` aside) whose values differ, sorted."""
    if start is None:
        return ["<no start environment>"]
    keys = (set(start) | set(parent)) - set(VOLATILE)
    return sorted(k for k in keys if start.get(k) != parent.get(k))


def _module_files() -> dict[str, str]:
    out = {}
    for name, mod in list(sys.modules.items()):
        spec = getattr(mod, "__spec__", None)
        if spec is not None and spec.has_location and isinstance(spec.origin, str):
            out[name] = spec.origin
    return out


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def snapshot() -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Every module file loaded in this process now: name -> (file, (mtime_ns, size))."""
    return {name: (path, _stat(path)) for name, path in _module_files().items()}


LOADED = snapshot()


def changed_files(loaded: dict[str, tuple[str, tuple[int, int] | None]]) -> list[str]:
    """Modules in ``loaded`` whose file is not, in size and modification time, the one loaded."""
    return sorted(name for name, (path, st) in loaded.items() if _stat(path) != st)


def _resolve(name: str):
    """The spec a fresh ``import name`` (a top-level name) would find through ``sys.meta_path``
    and ``sys.path`` as they are now, ignoring ``sys.modules``."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, None)
        except Exception:  # noqa: BLE001 - a finder that fails cannot vouch for the module
            return None
        if spec is not None:
            return spec
    return None


def moved_packages() -> list[str]:
    """Top-level modules loaded here from a file other than the one a fresh import would load
    now (a spawned rank imports through the parent's ``sys.path``, which the forked rank has
    been given: a module the server found elsewhere is not the code a spawned rank runs)."""
    out = []
    for name, path in _module_files().items():
        if "." in name or name.startswith("__"):
            continue
        spec = _resolve(name)
        if spec is None or spec.origin != path:
            out.append(name)
    return sorted(out)


def interpreter() -> list[str]:
    """What a child process started now runs: the executable and the interpreter flags."""
    from multiprocessing import spawn, util

    return [os.fsdecode(a) for a in (spawn.get_executable(), *util._args_from_interpreter_flags())]


def differences(parent_env: dict[str, str], parent_interpreter: list[str]) -> list[str]:
    """In a rank forked from the server, after multiprocessing gave it the parent's
    ``sys.path`` and folder: why it is not what a spawned rank would be (empty: it is)."""
    out = [f"environment variable {k}" for k in environ_differences(start_environ(), parent_env)]
    argv = list(getattr(sys, "orig_argv", []))
    # the server runs ``<executable> <flags> -c <code>``
    if len(argv) < 2 or argv[-2] != "-c" or argv[:-2] != list(parent_interpreter):
        out.append(f"interpreter {argv[:-2]} (a spawned rank runs {parent_interpreter})")
    out += [f"module {m} changed on disk since the server loaded it" for m in changed_files(LOADED)]
    out += [f"module {m} would be imported from elsewhere" for m in moved_packages()]
    return out
