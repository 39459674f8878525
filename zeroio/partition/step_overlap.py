"""A host optimizer step run on a worker thread, chunk by chunk, that others wait on by prefix.

[Note: step overlap]
With host masters (offload_optimizer cpu) the step is CPU Adam over chunks of
the shard, each followed by its publication (H2D copy, 16-bit cast on the GPU,
all-gather of a finished bucket). ``StepRunner`` runs those jobs in order on
one worker thread and counts the finished ones under a condition variable.
The partitioner's forward pre-hooks call ``wait_for(i)`` with the last job
their module's parameters depend on, then make the compute stream wait on the
CUDA event the job recorded, so the next forward starts on the first layers
while the CPU still updates the last ones. Jobs run in global parameter order
(the order a forward reads them), so ``i`` is reached early for early layers.
An exception on the worker is kept and raised by the next ``wait_for``/``join``
on the caller's thread, as a ``HostStepError`` whose cause is the worker's error
(the engine's step guard knows it as a failed step, wherever it surfaces:
[Note: atomic step] in zeroio/step_guard.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from zeroio.config import overrides
from zeroio.config.launch_env import launch_env
from zeroio.errors import HostStepError
from zeroio.tiering.breakdown import HostRecord


def step_threads() -> int:
    """CPU threads of the host step: ``ZEROIO_STEP_THREADS`` (a process override,
    config/overrides.py), else this rank's share of the host's cores (``cpu_share``). Not
    torch's thread count: torchrun sets OMP_NUM_THREADS=1 in every rank it starts, which made
    the step single-threaded (2.4x slower at 2 ranks in benchmarks/train_peers.py --nproc 2)
    and DeepSpeed's CPU Adam likewise."""
    n = overrides.host_step_threads()
    return cpu_share() if n is None else n


def cpu_share(ranks: int | None = None) -> int:
    """The CPUs this process may run on, divided among ``ranks`` processes of this host
    (default: ``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 without it), at least 1."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    if ranks is None:
        ranks = launch_env().local_world_size or 1
    return max(1, usable // max(1, ranks))


class PhaseClock:
    """Seconds per named phase of the host step, summed over jobs and steps (any thread), and
    the per-step record of [Note: step breakdown] (tiering/breakdown.py).

    The worker thread is invisible to torch.profiler's op table, so this is where a step's
    time is split: ``worker`` (the whole job loop), ``adam`` (CPU Adam; with ``numel``, one
    chunk), ``publish`` (16-bit cast / copies behind each chunk), ``assist`` (handing chunks
    to the GPU). ``engine.stats()["timings"]`` reports the sums as ``host_<phase>_s``;
    ``take`` hands the engine what happened since it was last called (chunks, waits by
    reader, the worker's span)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.reader: str | None = None
        """The engine call the training thread is in (``reading``): whose waits these are."""
        self._rec = HostRecord()
        self._workers = 0

    @contextmanager
    def phase(self, name: str, numel: int | None = None) -> Iterator[None]:
        t = time.perf_counter()
        if name == "worker":
            with self._lock:
                self._workers += 1
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self.seconds[name] += t1 - t
                rec = self._rec
                rec.phases[name] = rec.phases.get(name, 0.0) + (t1 - t)
                if numel is not None:
                    rec.add_chunk(t, t1, numel, "cpu")
                if name == "worker":
                    self._workers -= 1
                    rec.worker = (t, t1) if rec.worker is None else (rec.worker[0], t1)

    def gpu_chunk(self, numel: int, span) -> None:
        """A chunk handed to the GPU (the step assist); ``span``: CUDA events around it there."""
        t = time.perf_counter()
        with self._lock:
            self._rec.add_chunk(t, t, numel, "gpu", span)

    @contextmanager
    def reading(self, reader: str) -> Iterator[None]:
        before, self.reader = self.reader, reader
        try:
            yield
        finally:
            self.reader = before

    def waited(self, t0: float, t1: float) -> None:
        """The training thread blocked on the host step from ``t0`` to ``t1``."""
        with self._lock:
            self._rec.add_wait(self.reader or "other", t0, t1)

    @property
    def busy(self) -> bool:
        """A worker is inside its job loop (its record is still growing)."""
        with self._lock:
            return self._workers > 0

    def peek(self) -> HostRecord:
        return self._rec

    def take(self) -> HostRecord:
        with self._lock:
            rec, self._rec = self._rec, HostRecord()
        return rec

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {f"host_{k}_s": v for k, v in self.seconds.items()}


class StepRunner:
    """Runs ``job(i)`` for i in 0..n-1 on one worker thread; ``wait_for(i)`` blocks until job i
    is done. ``events[i]`` (CUDA only) is recorded by job i behind its copies."""

    def __init__(self, n_jobs: int, device: torch.device, clock: PhaseClock | None = None):
        self.n_jobs = n_jobs
        self.clock = clock or PhaseClock()
        self.events = ([torch.cuda.Event() for _ in range(n_jobs)]
                       if device.type == "cuda" else None)
        self._cond = threading.Condition()
        self._done = n_jobs
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._worker: int | None = None
        """``threading.get_ident()`` of the worker running the jobs (None between steps)."""

    @property
    def running(self) -> bool:
        """A step was started and not joined yet (read on the thread that starts and joins)."""
        return self._thread is not None

    def start(self, job: Callable[[int], None]) -> None:
        if self._thread is not None:
            self.join()
        with self._cond:
            self._done, self._error = 0, None
        threads = step_threads()  # a new thread would get OpenMP's default, not ours
        self._thread = threading.Thread(target=self._run, args=(job, threads),
                                        name="zeroio-step", daemon=True)
        self._thread.start()

    def on_worker(self) -> bool:
        """Whether the caller is this runner's worker thread, running a job (also while the
        starting thread is blocked in ``join``, when ``running`` is already False)."""
        return self._worker == threading.get_ident()

    def _run(self, job: Callable[[int], None], threads: int) -> None:
        self._worker = threading.get_ident()
        torch.set_num_threads(threads)
        try:
            with self.clock.phase("worker"):
                for i in range(self.n_jobs):
                    job(i)
                    with self._cond:
                        self._done = i + 1
                        self._cond.notify_all()
        except BaseException as e:  # handed to the waiting thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def wait_for(self, i: int) -> None:
        """Block until job ``i`` finished (``i < 0``: nothing to wait for)."""
        with self._cond:
            if self._done <= i and self._error is None:
                t0 = time.perf_counter()
                while self._done <= i and self._error is None:
                    self._cond.wait()
                self.clock.waited(t0, time.perf_counter())
            if self._error is not None:
                raise _surfaced(self._error)

    def join(self) -> None:
        """Wait for every job; re-raise the worker's exception once."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive():  # a wait on the host step ([Note: step breakdown])
            t0 = time.perf_counter()
            thread.join()
            self.clock.waited(t0, time.perf_counter())
        else:
            thread.join()
        self._worker = None
        with self._cond:
            error, self._error = self._error, None
            self._done = self.n_jobs
        if error is not None:
            raise _surfaced(error)


def _surfaced(error: BaseException) -> HostStepError:
    """The worker's error as the training thread sees it (a new exception each time: the
    worker's is its cause, not re-raised with another traceback appended)."""
    err = HostStepError(f"the optimizer step on the host-step worker failed: "
                        f"{type(error).__name__}: {error}")
    err.__cause__ = error
    return err
