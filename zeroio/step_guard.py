"""The optimizer step as a transaction: it completes, or fails leaving the engine as before
it, or fails and the engine refuses to go on until a checkpoint is loaded.

[Note: atomic step]
DESIGN.md promises that a failed optimizer step (swap I/O, ENOSPC, a worker error, a
signal) leaves masters, moments, 16-bit parameters, step counters, loss scale and LR
schedule as before it, or that the engine refuses every further step and save until a
checkpoint is loaded. ``StepGuard`` keeps that promise for ``Engine.step``:

- Scalars are always restored, whether the tensors roll back or not. Before the step it snapshots ``global_steps``,
  ``micro_steps``, ``global_samples``, ``skipped_steps``, the last norm, the loss
  scaler, the LR scheduler (its ``state_dict``), the optimizer's param-group
  hyper-parameters and its step counters: a few hundred bytes.
- State tensors are not copied. A pre-step copy of the masters is as large as the
  master shard, and moments a streamed step already wrote over their swap files would
  need a second file each; neither is affordable at the sizes zeroio is for. Instead
  the step tells whether it has begun changing them: the engine marks the update
  phase (``updating``; nothing before it — the norm, the overflow check — changes a
  tensor) and an optimizer that knows better says so with ``touched`` (``SwappedAdam``
  orders its reads first: [Note: reads before writes] in optim/swap.py). An optimizer
  without ``touched`` counts as having changed state once the update phase began.
- A failure with nothing changed rolls back: scalars restored, the accumulation
  window's gradients discarded (``partitioner.zero_grad``; ``micro_steps`` back to the
  window's first micro step), I/O errors the store kept cleared (the retry reads
  afresh). The caller reruns the window's micro batches and steps: bit-identical to a
  run without the failure. The error is re-raised as it was when it is a zeroio error;
  a foreign one becomes ``StepFailedError(rolled_back=True)`` with it as the cause.
- A failure after something changed poisons the engine: ``StepFailedError`` names the
  cause, and every later forward, backward, step, save_checkpoint and save_16bit_model
  raises it again (so no checkpoint can commit the half-applied step) until
  ``load_checkpoint`` succeeds, which also clears the store's kept I/O errors (an
  ENOSPC whose space was since freed must not fail the next step again).
- ``KeyboardInterrupt`` and ``SystemExit`` keep their type (Ctrl-C must still stop the
  program); the engine is rolled back or poisoned as for any other failure.
- Ranks agree. Between the update and the publication of the new parameters (a
  collective) each rank votes with one small all-reduce: whether its step failed, and
  whether its state changed. A rank whose step failed would otherwise leave the others
  waiting in the publication; with the vote, all roll back when every rank failed with
  nothing changed, and all refuse to go on otherwise (a rank that stepped cannot undo
  it). A failure before the update phase is the same on every rank (the norm is
  global); one after the vote is local and poisons that rank.
- A vote that fails poisons, whatever this rank's own state. Rolling back is safe only
  where the vote proved that no rank changed anything; a vote that raised (a peer slower
  than ``distributed.timeout_s``, a lost peer) proves nothing: the other ranks may have
  applied the step. So the guard never votes twice (a second collective on a world whose
  first one failed fails as well, or pairs with a peer's late first vote) and refuses to
  go on. A collective that timed out leaves the process group unusable (gloo closes the
  pairs, NCCL aborts the communicator): the refusal says so, and the remedy is a restart
  that loads the checkpoint (``zeroio train --resume``).
- An overlapped host step (``tiering.overlap_step``, zeroio/partition/step_overlap.py)
  runs on after ``step`` returns; its failure surfaces as ``HostStepError`` in the next
  forward, backward, step or synchronize. The step's scalars were already counted and
  its state half-written, so that always poisons (``watch``).
"""

from __future__ import annotations

import copy
import enum
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from zeroio.errors import DistributedError, HostStepError, StepFailedError, ZeroIOError

LOAD_HINT = "load a checkpoint (engine.load_checkpoint) to continue"


class StepPhase(enum.Enum):
    IDLE = "idle"  # no step running
    PREPARING = "preparing"  # norm, overflow check: nothing changed yet
    UPDATING = "updating"  # the optimizer updates state (ranks vote after it)
    UPDATING_ALONE = "updating-alone"  # an overlapped step: no vote
    VOTE_FAILED = "vote-failed"  # the vote itself raised: whether others applied is unknown
    AGREED = "agreed"  # every rank's update succeeded: publication, scalars


@dataclass(frozen=True, kw_only=True)
class Scalars:
    """What a step changes besides state tensors, as it was before the step."""

    counters: dict[str, Any]
    loss_scaler: dict
    scheduler: dict | None
    param_groups: list[dict]
    optimizer_steps: list[int]

    COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps",
                "last_grad_norm", "_step_applied")

    @classmethod
    def take(cls, engine) -> Scalars:
        sched = engine.lr_scheduler
        opt = engine.optimizer
        groups = range(len(engine.partitioner.groups))
        return cls(counters={k: getattr(engine, k) for k in cls.COUNTERS},
                   loss_scaler=copy.deepcopy(engine.loss_scaler.state_dict()),
                   scheduler=copy.deepcopy(sched.state_dict()) if hasattr(sched, "state_dict")
                   else None,
                   param_groups=[{k: v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups],
                   optimizer_steps=[opt.steps_taken(i) for i in groups])

    def restore(self, engine) -> None:
        for k, v in self.counters.items():
            setattr(engine, k, v)
        engine.loss_scaler.load_state_dict(copy.deepcopy(self.loss_scaler))
        if self.scheduler is not None:
            engine.lr_scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        for live, saved in zip(engine.optimizer.param_groups, self.param_groups, strict=True):
            live.update(saved)
        for i, n in enumerate(self.optimizer_steps):
            engine.optimizer.set_steps(i, n)


class StepGuard:
    """One engine's step transaction and its refusal state ([Note: atomic step])."""

    def __init__(self, engine):
        self._engine = engine
        self.phase = StepPhase.IDLE
        self.failure: str | None = None
        """Why the engine refuses to go on (None: it is usable)."""
        self._cause: BaseException | None = None

    # ---- refusal ----------------------------------------------------------------------------

    def check(self, what: str) -> None:
        """Raise the one refusal error while a failed step is not replaced by a load."""
        if self.failure is not None:
            raise StepFailedError(f"{what} refused: {self.failure}") from self._cause

    def _poison(self, why: str, cause: BaseException | None) -> StepFailedError:
        self.failure = (f"{why}; masters, moments and parameters may be half-updated, so the "
                        f"engine refuses forward, backward, step and save_checkpoint: {LOAD_HINT}")
        self._cause = cause
        self._clear_io_errors()  # release what the step held: the load needs the window
        err = StepFailedError(self.failure)
        err.__cause__ = cause
        return err

    # ---- the synchronous step ---------------------------------------------------------------

    @contextmanager
    def step(self, settle=None):
        """Around ``Engine.step``'s work at a boundary. ``settle``: waits for an overlapped
        previous step first (its failure poisons), so the snapshot sees its counters."""
        self.check("step")
        if settle is not None:
            with self.watch():
                settle()
        before = Scalars.take(self._engine)
        self.phase = StepPhase.PREPARING
        try:
            yield
        except BaseException as exc:
            self._failed(exc, before)
        finally:
            self.phase = StepPhase.IDLE

    def updating(self, *, vote: bool = True) -> None:
        """The optimizer is about to change state tensors; ``vote``: the engine calls
        ``agree`` once the update is done (False: an overlapped step, which runs on)."""
        self.phase = StepPhase.UPDATING if vote else StepPhase.UPDATING_ALONE

    def agree(self) -> None:
        """Every rank's update succeeded, or every rank learns that one failed (one small
        all-reduce; nothing with one rank)."""
        try:
            any_failed, _ = self._vote(failed=False, changed=True)
        except BaseException:
            self.phase = StepPhase.VOTE_FAILED  # poisons: [Note: atomic step]
            raise
        self.phase = StepPhase.AGREED
        if any_failed:
            raise _PeerFailed()

    def _vote(self, *, failed: bool, changed: bool) -> tuple[bool, bool]:
        from zeroio.partition import collectives as comm

        if comm.world_size() == 1:
            return failed, changed
        flags = torch.tensor([float(failed), float(changed)], dtype=torch.float32,
                             device=self._engine._comm_device())
        comm.all_reduce_scalar(flags, op="max")
        return bool(flags[0].item()), bool(flags[1].item())

    def _failed(self, exc: BaseException, before: Scalars) -> None:
        engine = self._engine
        at = before.counters["global_steps"]
        if isinstance(exc, HostStepError):  # the previous, overlapped step
            cause = exc.__cause__ or exc
            raise self._poison(f"the overlapped optimizer step before global step {at} failed "
                               f"({exc})", cause) from cause
        before.restore(engine)  # scalars always: whatever happens to the tensors
        if isinstance(exc, _PeerFailed):
            raise self._poison(f"the optimizer step at global step {at} failed on another "
                               "rank after this rank's step was applied", None) from None
        if self.phase is StepPhase.VOTE_FAILED:
            self._vote_failed(exc, at)
        changed = self._changed()
        if self.phase is StepPhase.UPDATING:
            try:
                _, changed = self._vote(failed=True, changed=changed)
            except BaseException as vote_exc:  # noqa: BLE001 - poisons, then re-raised
                self._vote_failed(vote_exc, at, first=exc)
        cause = _one_line(exc)
        if changed:
            err = self._poison(f"the optimizer step at global step {at} failed after it began "
                               f"changing state ({cause})", exc)
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt, SystemExit: keep their meaning
            raise err from exc
        gas = engine.gradient_accumulation_steps()
        engine.micro_steps = before.counters["micro_steps"] + 1 - gas  # the window's start
        engine.partitioner.zero_grad()
        self._clear_io_errors()
        if isinstance(exc, ZeroIOError) or not isinstance(exc, Exception):
            raise exc
        raise StepFailedError(
            f"the optimizer step at global step {at} failed before it changed any state "
            f"({cause}); the engine is as before the step and this accumulation window's "
            "gradients are discarded: run its micro batches again, then step",
            rolled_back=True) from exc

    def _vote_failed(self, vote_exc: BaseException, at: int,
                     first: BaseException | None = None) -> None:
        """Poison after the ranks' vote raised ([Note: atomic step]) and raise the refusal
        (a KeyboardInterrupt or SystemExit that cut the vote keeps its type)."""
        step = (f"failed ({_one_line(first)}) and " if first is not None else "")
        why = (f"the optimizer step at global step {at} {step}the ranks' vote on it failed "
               f"({_one_line(vote_exc)}): the other ranks may have applied it")
        if isinstance(vote_exc, DistributedError):
            why += ("; the process group is unusable after a failed collective, so restart the "
                    "job and load the checkpoint there (zeroio train --resume)")
        err = self._poison(why, vote_exc)
        if not isinstance(vote_exc, Exception):
            raise vote_exc
        raise err from vote_exc

    def _changed(self) -> bool:
        if self.phase in (StepPhase.IDLE, StepPhase.PREPARING):
            return False
        if self.phase is StepPhase.AGREED:
            return True
        return bool(getattr(self._engine.optimizer, "touched", True))

    def _clear_io_errors(self) -> None:
        clear = getattr(self._engine.optimizer, "clear_errors", None)
        if clear is not None:
            clear()

    # ---- failures surfacing later, and loads -------------------------------------------------

    @contextmanager
    def watch(self):
        """Around forward, backward and synchronize: an overlapped step's failure surfacing
        there poisons the engine."""
        try:
            yield
        except HostStepError as exc:
            if self.failure is not None:
                raise StepFailedError(self.failure) from self._cause
            cause = exc.__cause__ or exc
            raise self._poison(f"the overlapped optimizer step before global step "
                               f"{self._engine.global_steps} failed ({exc})",
                               cause) from cause

    def before_load(self) -> None:
        """Let an overlapped step finish (its failure is replaced by the load) and forget the
        I/O errors the store kept, so the load reads and writes afresh."""
        try:
            with self.watch():
                self._engine.partitioner.wait_step()
        except StepFailedError:
            pass  # the engine is poisoned: the load is what clears it
        self._clear_io_errors()

    def loaded(self) -> None:
        """A checkpoint load succeeded: the engine is usable again, with no gradient of the
        failed step's window left to add to."""
        if self.failure is not None:
            self._engine.partitioner.zero_grad()
        self.failure, self._cause = None, None


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line (a backend's message may span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class _PeerFailed(Exception):
    """Another rank's step failed while this rank's succeeded (internal to the guard)."""


__all__ = ["LOAD_HINT", "StepPhase", "Scalars", "StepGuard"]
