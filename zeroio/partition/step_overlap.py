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
on the caller's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class StepRunner:
    """Runs ``job(i)`` for i in 0..n-1 on one worker thread; ``wait_for(i)`` blocks until job i
    is done. ``events[i]`` (CUDA only) is recorded by job i behind its copies."""

    def __init__(self, n_jobs: int, device: torch.device):
        self.n_jobs = n_jobs
        self.events = ([torch.cuda.Event() for _ in range(n_jobs)]
                       if device.type == "cuda" else None)
        self._cond = threading.Condition()
        self._done = n_jobs
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """A step was started and not joined yet (read on the thread that starts and joins)."""
        return self._thread is not None

    def start(self, job: Callable[[int], None]) -> None:
        if self._thread is not None:
            self.join()
        with self._cond:
            self._done, self._error = 0, None
        threads = torch.get_num_threads()  # a new thread would get OpenMP's default, not ours
        self._thread = threading.Thread(target=self._run, args=(job, threads),
                                        name="zeroio-step", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[int], None], threads: int) -> None:
        torch.set_num_threads(threads)
        try:
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
            while self._done <= i and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def join(self) -> None:
        """Wait for every job; re-raise the worker's exception once."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        with self._cond:
            error, self._error = self._error, None
            self._done = self.n_jobs
        if error is not None:
            raise error
