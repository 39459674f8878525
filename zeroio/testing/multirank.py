"""Run a function on N ranks as separate processes and bring back their results.

    from zeroio.testing import run_ranks

    def body(x):                      # module level: it is imported by each rank
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + x)])
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(body, 2, 1.0) == [3.0, 3.0]

Each rank is a fresh process with a gloo (or NCCL) process group already initialised and
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set, so code under test that reads the
environment sees a ``torchrun``-like world.

[Note: forkserver ranks] A ``spawn`` rank pays ``import torch`` and zeroio (seconds each on
a small machine, more than most tests' work). So ranks are forked from a ``forkserver`` that
imported ``PRELOAD`` once and has done nothing else: no thread pool used, no CUDA, no process
group. Such a rank is what a spawned one would be only if the server started with the
environment the rank would get, because variables read once at process start (glibc's
``MALLOC_*``, OpenMP's ``OMP_*``, read while the server loaded them) come from there. So each
forked rank compares its start environment (``/proc/self/environ``) with the parent's (after
``env``), before it does anything; on any difference (``_VOLATILE`` aside) every rank
is stopped and the job runs again on ``spawn``. The Python-level environment is then set to
the parent's exactly. NCCL jobs, and any job without ``/proc`` (not Linux), are spawned.

A rank that raises has its traceback re-raised in the caller as
``RankFailedError``; a run that exceeds ``timeout`` kills every rank and raises
``TimeoutError`` naming the ranks still running. Results travel back through
a multiprocessing queue (process memory, never a file).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from zeroio.cli.ports import free_port
from zeroio.errors import RankFailedError

PRELOAD = ("torch", "torch.distributed", "zeroio.partition.collectives", "zeroio.engine")
"""What the forkserver imports once for every forked rank (see the note above)."""
# Set in this process by pytest (per test phase) and by torch's inductor (its cache folder, on
# the first compile); both are read through ``os.environ`` only, never at process start.
_VOLATILE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
_PROC_ENVIRON = "/proc/self/environ"


class _Respawn(Exception):
    """A forked rank's start environment differs from the parent's: run the job on spawn."""


def _start_environ() -> dict[str, str] | None:
    """The environment this process started with (None where /proc is not readable)."""
    try:
        with open(_PROC_ENVIRON, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
    return {k.decode(errors="surrogateescape"): v.decode(errors="surrogateescape")
            for k, v in pairs}


def _process_environ() -> dict[str, str] | None:
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


def _without_volatile(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _VOLATILE}


def _rank_main(fn, rank, world_size, port, backend, threads, env, args, kwargs, out,
               received, parent_env=None) -> None:
    if parent_env is not None:  # forked from the forkserver: started as a spawned rank would?
        if _without_volatile(_start_environ() or {}) != _without_volatile(parent_env):
            out.put((rank, None, "start environment differs from the parent's"))
            return
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        from zeroio.partition import collectives

        if threads:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        collectives.init_world(backend, 120.0, rank=rank, world_size=world_size)
        try:
            result = fn(*args, **kwargs)
        finally:
            collectives.destroy_world()
        out.put((rank, True, result))
        # a tensor in the result travels as a file descriptor that the parent fetches from
        # this process while it unpickles: exiting first loses it (EOFError in the parent)
        received.wait(timeout=300)
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    threads: int | None = 1,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, by rank.

    ``fn`` must be importable at module level (spawned processes import it).
    ``threads`` caps torch's intra-op threads per rank (None leaves torch's
    default), so several ranks on a small machine do not oversubscribe it.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    job = (fn, world_size, args, kwargs, timeout, backend, threads, dict(env or {}))
    # NCCL ranks are always spawned: nothing CUDA-related is ever inherited through a fork
    if backend == "gloo" and _start_environ() is not None and _process_environ() is not None:
        try:
            return _run(*job, forked=True)
        except _Respawn:
            pass
    return _run(*job, forked=False)


def start_forkserver():
    """Start the forkserver now (it loads ``PRELOAD`` in the background), with this process's
    environment as it is: a test session calls this before any test can ``monkeypatch`` it,
    so that later jobs fork. Otherwise the first job starts it. Returns the context."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # a no-op once the server runs
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return ctx


def _forkserver_context():
    return start_forkserver()  # before ``env`` touches this process's environment


def _run(fn, world_size, args, kwargs, timeout, backend, threads, env, *, forked) -> list[Any]:
    ctx = _forkserver_context() if forked else mp.get_context("spawn")
    out = ctx.Queue()
    received = [ctx.Event() for _ in range(world_size)]
    port = free_port()
    # A spawned child takes its environment from the parent at start; variables read
    # once at process start (glibc's MALLOC_*, OMP_*) only work if set before it.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        parent_env = _process_environ() if forked else None
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, port, backend, threads, env, args, kwargs, out,
                      received[r], parent_env),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(
                    f"run_ranks({getattr(fn, '__name__', fn)}): ranks {missing} still running "
                    f"after {timeout:.0f} s; all ranks were killed"
                )
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 1.0))
                received[rank].set()
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)
                ]
                if dead:
                    # give a rank that crashed after queueing its traceback a moment to arrive
                    try:
                        rank, ok, payload = out.get(timeout=2.0)
                        received[rank].set()
                    except queue.Empty:
                        r = dead[0]
                        raise RankFailedError(
                            r, f"process exited with code {procs[r].exitcode} and no traceback"
                        ) from None
                else:
                    continue
            if ok is None:
                raise _Respawn(payload)
            if not ok:
                raise RankFailedError(rank, payload)
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    return [results[r] for r in range(world_size)]


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "ZEROIO_LAUNCHER_PID")
"""What a launcher sets for its ranks: a command started by a test must not inherit it."""


def outside_launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``LAUNCH_ENV``, with one intra-op thread per process,
    unbuffered output and ``extra``: for tests that start ``zeroio`` commands themselves."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
