"""Run a function on N ranks as separate processes and bring back their results.

    from zeroio.testing import run_ranks

    def body(x):                      # module level: it is imported by each rank
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + x)])
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(body, 2, 1.0) == [3.0, 3.0]

Each rank is a fresh ``spawn`` process with a gloo (or NCCL) process group
already initialised and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set,
so code under test that reads the environment sees a ``torchrun``-like world.
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


def _rank_main(fn, rank, world_size, port, backend, threads, env, args, kwargs, out,
               received) -> None:
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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    received = [ctx.Event() for _ in range(world_size)]
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, backend, threads, dict(env or {}), args, kwargs, out,
                  received[r]),
            daemon=False,
        )
        for r in range(world_size)
    ]
    # A spawned child takes its environment from the parent at start; variables read
    # once at process start (glibc's MALLOC_*, OMP_*) only work if set before it.
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
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
