"""SIGTERM and SIGINT deferred to the step boundary: finish the step, checkpoint, clean up, exit.

    with zeroio.preemption.deferred_signals() as signals:
        for batch in loader:
            if signals.stop_now():             # collective: every rank calls it, each step
                engine.save_checkpoint(save_dir)
                break
            engine.backward(engine(batch)); engine.step()
    engine.close()
    sys.exit(signals.exit_code)                # 143 after SIGTERM, 130 after SIGINT, else 0

[Note: signals at the step boundary]
A scheduler preempts a job with SIGTERM (then SIGKILL after a grace period); a user stops it
with Ctrl-C (SIGINT). Either may arrive in the middle of an optimizer step or of a checkpoint
write. Python's default SIGTERM ends the process at once (no ``finally`` runs: swap folders and
a half-written checkpoint stay) and its SIGINT raises ``KeyboardInterrupt`` wherever the main
thread happens to be. Inside ``deferred_signals`` both only record that they came; the loop
asks ``stop_now()`` at each step boundary, so a signal never cuts a step or a save in two.

The ranks must stop at the same boundary (a rank that stops while another starts the next
step's collectives hangs it), and a launcher or scheduler signals them at slightly different
moments: ``stop_now`` is therefore a collective, one max-all-reduce of the signal number, and
every rank returns the same answer. In a world of one (or no process group) it is local.

A second SIGINT while one is pending raises ``KeyboardInterrupt`` at once (Ctrl-C twice: the
user insists, e.g. on a step that hangs). Repeated SIGTERMs are not escalated: a scheduler and a
launcher may both forward the same preemption. SIGKILL cannot be caught; the swap folders a
killed run leaves are removed by the next run on the same ``nvme_path`` (io/swapdir.py).

Outside ``deferred_signals`` the engine still keeps its optimizer step and its checkpoint
writes whole (``uninterrupted``): a signal that arrives inside one is held and re-delivered to
the handler in place once it ended (Python's ``KeyboardInterrupt``, SIGTERM's termination).

Exit status: 128 + the signal's number, as shells report a process that a signal ended: 143
for SIGTERM, 130 for SIGINT; 0 when no stop was agreed (a signal that arrived after the last
``stop_now`` lets the run finish its work).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType

import torch

from zeroio.errors import ZeroIOError
from zeroio.partition import collectives as comm

SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


class StepBoundarySignals:
    """SIGTERM/SIGINT recorded, not acted on, until ``stop_now()`` at a step boundary."""

    def __init__(self, signals: Iterable[int] = SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        """The first signal this process got (None: none yet)."""
        self.stopped: signal.Signals | None = None
        """The signal every rank agreed to stop on (set by the ``stop_now`` that said True)."""
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StepBoundarySignals:
        if threading.current_thread() is not threading.main_thread():
            raise ZeroIOError("zeroio.preemption.deferred_signals() must be entered on the main "
                              "thread (Python delivers signals there only)")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
        elif sig == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: [Note: signals at the step boundary]

    def stop_now(self) -> bool:
        """Whether to stop at this boundary: True on every rank when any rank got a signal.
        A collective when a process group of more than one rank is joined: call it on every
        rank at the same boundary."""
        if self.stopped is not None:
            return True
        mine = int(self.received or 0)
        if comm.world_size() > 1:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if comm.backend() == "nccl" else torch.device("cpu"))
            flag = torch.tensor([mine], dtype=torch.int32, device=device)
            comm.all_reduce_scalar(flag, op="max")
            mine = int(flag.item())
        if mine:
            self.stopped = signal.Signals(mine)
        return self.stopped is not None

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal's number (143 SIGTERM, 130 SIGINT); 0 when none stopped."""
        return 128 + int(self.stopped) if self.stopped is not None else 0


def deferred_signals(signals: Iterable[int] = SIGNALS) -> StepBoundarySignals:
    """A context manager deferring ``signals`` (SIGTERM, SIGINT) to ``stop_now()``: [Note:
    signals at the step boundary]. The previous handlers come back on exit."""
    return StepBoundarySignals(signals)


class _Held:
    """SIGTERM/SIGINT held for the length of one section, re-delivered after it."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> _Held:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: nothing can cut this one
        for s in SIGNALS:
            handler = signal.getsignal(s)
            if handler is None or isinstance(getattr(handler, "__self__", None),
                                             StepBoundarySignals):
                continue  # not Python's to change; or deferred_signals already defers it
            self.previous[s] = signal.signal(s, lambda n, f: self.pending.append(n))
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        for n in dict.fromkeys(self.pending):
            signal.raise_signal(n)  # the handler that was in place acts now, after the section


def uninterrupted() -> _Held:
    """A section no SIGTERM/SIGINT cuts (an optimizer step, a checkpoint write): one that
    arrives is held and re-delivered to the handler in place once the section ended (Python's
    KeyboardInterrupt, the default termination, the user's handler). Inside
    ``deferred_signals`` the section adds nothing; off the main thread it is a no-op."""
    return _Held()


def stop_line(summary: dict) -> str:
    """The one line a run stopped by a signal prints, from its summary (``stopped_by``,
    ``end_step``, ``steps``, ``checkpoint``, ``exit_code``)."""
    saved = summary.get("checkpoint")
    where = (f"checkpoint {saved}; continue with --resume" if saved else
             "no checkpoint written at this step")
    return (f"zeroio train: stopped by {summary['stopped_by']} after step {summary['end_step']} "
            f"of {summary['steps']}; {where} (exit {summary['exit_code']})")


__all__ = ["SIGNALS", "StepBoundarySignals", "deferred_signals", "stop_line", "uninterrupted"]
