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
environment the rank would get (variables read at process start, glibc's ``MALLOC_*``, or
while the server imported torch, OpenMP's ``OMP_*``, come from there), runs the same
interpreter with the same flags, and holds the code a spawned rank would import now: the
same files, found through the parent's ``sys.path``, unchanged since the server read them.
Each forked rank checks all of that (``fork_identity.differences``) before it does
anything; on any difference every rank is stopped and the job runs again on ``spawn``, and
``LAST_START`` says why. The Python-level environment is then set to the parent's exactly,
and then to the job's ``env=``, before anything else runs: a job may fork only where each
variable it changes is one nothing reads until later (``fork_identity.SAFE_AFTER_FORK``,
each with its reason; e.g. ``CUDA_VISIBLE_DEVICES``, read when CUDA initialises, which the
rank checks the server never did); any other variable makes the job spawn. NCCL jobs, and
any job without ``/proc`` (not Linux), are spawned.

A rank that raises has its traceback re-raised in the caller as
``RankFailedError``; a run that exceeds ``timeout`` kills every rank and raises
``TimeoutError`` naming the ranks still running. Results travel back through
a multiprocessing queue (process memory, never a file).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from zeroio.cli.ports import free_port
from zeroio.errors import RankFailedError
from zeroio.testing import fork_identity

PRELOAD = ("torch", "torch.distributed", "zeroio.partition.collectives", "zeroio.engine",
           "zeroio.testing.fork_identity")
"""What the forkserver imports once for every forked rank (see the note above); the last entry
records the module files the server loaded, to tell later whether they changed."""

LAST_START: dict[str, Any] = {}
"""How the latest job in this process started: ``{"start": "fork" | "spawn", "why": [...]}``,
``why`` naming what made it spawn (empty where it forked, or where forking was not tried)."""


class _Respawn(Exception):
    """A forked rank is not what a spawned one would be: run the job on spawn."""

    def __init__(self, why: list[str]):
        super().__init__("; ".join(why))
        self.why = why


def _rank_main(fn, rank, world_size, port, backend, threads, env, args, kwargs, out,
               received, parent=None, collective_timeout_s=120.0) -> None:
    if parent is not None:  # forked from the forkserver: is it what a spawned rank would be?
        parent_env, parent_interpreter = parent
        why = fork_identity.differences(parent_env, parent_interpreter, late=env)
        if why:
            out.put((rank, None, why))
            return
        os.environ.clear()
        os.environ.update(parent_env)
    # forked: only fork_identity.SAFE_AFTER_FORK variables, set before anything reads them;
    # spawned: already there from process start
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
        collectives.init_world(backend, collective_timeout_s, rank=rank, world_size=world_size)
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
    collective_timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, by rank.

    ``fn`` must be importable at module level (spawned processes import it).
    ``threads`` caps torch's intra-op threads per rank (None leaves torch's
    default), so several ranks on a small machine do not oversubscribe it.
    ``collective_timeout_s``: the process group's timeout (``distributed.timeout_s`` of a
    launched job), for tests of what a collective that outlasts it does.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    env = dict(env or {})
    job = (fn, world_size, args, kwargs, timeout, backend, threads, collective_timeout_s)
    late, why = fork_identity.set_after_fork(env, dict(os.environ))
    # NCCL ranks are always spawned: nothing CUDA-related is ever inherited through a fork
    if backend != "gloo":
        why = ["backend " + backend]
    if not why and fork_identity.start_environ() is None:
        why = ["no " + fork_identity.PROC_ENVIRON]
    if not why and fork_identity.process_environ() is None:
        why = ["no C-level environ"]
    if not why:
        try:
            results = _run(*job, late, forked=True)
            LAST_START.update(start="fork", why=[])
            return results
        except _Respawn as e:
            why = e.why
    results = _run(*job, env, forked=False)
    LAST_START.update(start="spawn", why=why)
    return results


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


def _check_server_environ(parent_env: dict[str, str]) -> None:
    """Raise ``_Respawn`` before forking when the server's start environment (read from
    ``/proc``) already differs from ``parent_env``; each rank checks again, and more."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        start = fork_identity.start_environ(f"/proc/{pid}/environ")
        why = [k for k in fork_identity.environ_differences(start, parent_env)
               if k not in fork_identity.SAFE_AFTER_FORK]
        if why:
            raise _Respawn([f"environment variable {k}" for k in why])


def _run(fn, world_size, args, kwargs, timeout, backend, threads, collective_timeout_s, env, *,
         forked) -> list[Any]:
    ctx = _forkserver_context() if forked else mp.get_context("spawn")
    out = ctx.Queue()
    received = [ctx.Event() for _ in range(world_size)]
    port = free_port()
    # A spawned child takes its environment from the parent at start; variables read
    # once at process start (glibc's MALLOC_*, OMP_*) only work if set before it. A forked
    # rank is handed the parent's environment as it is and sets ``env`` itself.
    saved = {} if forked else {k: os.environ.get(k) for k in env}
    if not forked:
        os.environ.update(env)
    try:
        parent = None
        if forked:
            parent = (fork_identity.process_environ() or {}, fork_identity.interpreter())
            try:
                _check_server_environ(parent[0])
            except _Respawn:
                out.close()
                raise
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, port, backend, threads, env, args, kwargs, out,
                      received[r], parent, collective_timeout_s),
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


def path_first(*dirs: str) -> str:
    """A ``PYTHONPATH`` value with ``dirs`` first and this process's own entries after them, so
    a child still finds the packages the parent found there (zarr and the like installed with
    ``pip --target`` on a machine that lacks them)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in dirs]
    return os.pathsep.join([*dirs, *kept])


@contextlib.contextmanager
def launcher_env_removed(*names: str) -> Iterator[None]:
    """This process's environment without ``LAUNCH_ENV`` and ``names`` inside the block, restored
    after: for tests that run a ``zeroio`` command's own ``main`` in this process."""
    saved = {k: os.environ.pop(k) for k in (*LAUNCH_ENV, *names) if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
