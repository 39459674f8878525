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

SAFE_AFTER_FORK = {
    "CUDA_VISIBLE_DEVICES": "read by the CUDA driver when CUDA initialises (cuInit) and by "
                            "torch.cuda's device count when it is called, never at process "
                            "start or at import; the server never initialises CUDA, and a "
                            "forked rank checks that (``cuda_differences``)",
    "CUDA_DEVICE_ORDER": "read with CUDA_VISIBLE_DEVICES, when CUDA initialises",
    "ZEROIO_CPU_ADAM": "read by zeroio.config.overrides at each call (engine build, step), "
                       "never at import",
    "ZEROIO_OVERLAP_STEP": "read by zeroio.config.overrides when a config is loaded",
    "ZEROIO_STEP_ASSIST": "read by zeroio.config.overrides when a config is loaded",
    "ZEROIO_STEP_CHUNK_NUMEL": "read by zeroio.config.overrides when a config is loaded",
    "ZEROIO_STEP_THREADS": "read by zeroio.config.overrides when the host step starts",
}
"""A job's ``env=`` variables (and the parent's own, changed since the server started) that a
forked rank may set in ``os.environ`` (and so the C-level
environment) as its first act, with the reason each is safe: nothing reads them at
interpreter start or while the server imported ``PRELOAD``, so a rank that sets them then
behaves as one spawned with them. A rank's ``/proc/self/environ`` still shows the server's
start environment. Any other variable a job sets (``MALLOC_*``, ``OMP_*``, ``PYTHON*``, an
unknown name) makes the job spawn; add a name here only with the reason it is safe."""

CUDA_SET_AFTER_FORK = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
"""The ``SAFE_AFTER_FORK`` variables that hold only while CUDA is untouched in the server."""

PROC_MAPS = "/proc/self/maps"


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


def set_after_fork(env: dict[str, str], now: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """A job's ``env=`` against the parent's environment ``now``: the variables a forked rank
    sets as its first act (those that change something), and why the job must spawn instead
    (each changed variable not in ``SAFE_AFTER_FORK``)."""
    late = {k: v for k, v in env.items() if now.get(k) != v}
    why = [f"environment variable {k} set for the job (not in fork_identity.SAFE_AFTER_FORK)"
           for k in sorted(late) if k not in SAFE_AFTER_FORK]
    return late, why


def cuda_differences(late: dict[str, str] | None = None, maps: str = PROC_MAPS) -> list[str]:
    """Why CUDA in this process is not as a fresh one's (empty: untouched). A forked rank is a
    copy of the server, so in one this is the server's state: CUDA initialised (or a bad
    fork) always counts; where ``late`` sets a ``CUDA_SET_AFTER_FORK`` variable, so does the
    CUDA driver library being loaded at all (the driver may have read the old value)."""
    torch = sys.modules.get("torch")
    out = []
    if torch is not None:
        if torch.cuda.is_initialized():
            out.append("CUDA initialised in the server")
        if torch.cuda._is_in_bad_fork():
            out.append("a CUDA bad fork")
    if late and any(k in late for k in CUDA_SET_AFTER_FORK):
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                loaded = any("/libcuda.so" in line for line in f)
        except OSError:
            loaded = True  # cannot tell: spawn
        if loaded:
            out.append("the CUDA driver library loaded in the server")
    return out


def differences(parent_env: dict[str, str], parent_interpreter: list[str],
                late: dict[str, str] | None = None) -> list[str]:
    """In a rank forked from the server, after multiprocessing gave it the parent's
    ``sys.path`` and folder: why it is not what a spawned rank would be (empty: it is), where
    the rank is to set ``late`` (``SAFE_AFTER_FORK`` variables) before anything else."""
    diff = environ_differences(start_environ(), parent_env)
    # a SAFE_AFTER_FORK variable the parent changed since the server started (a test's
    # monkeypatch.setenv) is set from parent_env with the rest, first, as the job's are
    late = {**{k: parent_env.get(k, "") for k in diff if k in SAFE_AFTER_FORK}, **(late or {})}
    out = [f"environment variable {k}" for k in diff if k not in SAFE_AFTER_FORK]
    out += cuda_differences(late)
    argv = list(getattr(sys, "orig_argv", []))
    # the server runs ``<executable> <flags> -c <code>``
    if len(argv) < 2 or argv[-2] != "-c" or argv[:-2] != list(parent_interpreter):
        out.append(f"interpreter {argv[:-2]} (a spawned rank runs {parent_interpreter})")
    out += [f"module {m} changed on disk since the server loaded it" for m in changed_files(LOADED)]
    out += [f"module {m} would be imported from elsewhere" for m in moved_packages()]
    return out
