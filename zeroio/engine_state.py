"""Where an ``Engine`` is in its micro step: the calls it accepts next, as an enum with named
transitions.

[Note: the micro-step protocol]
A micro step is ``forward`` (any number: an evaluation forward is one), one ``backward``, one
``step``; ``gradient_accumulation_steps`` micro steps make one optimizer step, taken by the
``step`` at the accumulation boundary. DeepSpeed defines the counting: ``step`` counts a micro
step on every call and steps the optimizer when ``(micro_steps + 1) %
gradient_accumulation_steps == 0`` (``is_gradient_accumulation_boundary``); zeroio keeps that.
DeepSpeed does not define what a ``step`` with no ``backward`` since the last one does (its
optimizer steps on whatever gradients are there, moving the masters by the Adam moments alone
and counting a step), nor a second ``backward`` before the ``step`` (its ZeRO-2 hooks reduce a
bucket again or assert, depending on the version and the bucket): in zeroio both are an
``EngineStateError`` that names the call and the fix, raised before anything moves, so the
engine is as it was and training can go on with the right call. A closed engine refuses every
call with ``EngineClosedError``.
"""

from __future__ import annotations

import contextlib
import enum

from zeroio.errors import EngineClosedError, EngineStateError


class Phase(enum.Enum):
    IDLE = "idle"
    """No gradient of the current micro step yet (start, after a step, after a load)."""
    FORWARD = "forward"
    """A forward ran since the last step; ``backward`` comes next (another forward is fine)."""
    BACKWARD_DONE = "backward done"
    """This micro step's gradients are reduced; ``step`` comes next."""
    CLOSED = "closed"
    """``close()`` released the engine's files, memory and threads; nothing is accepted."""


# (phase, call) -> next phase; a pair not listed is refused (see ``_refusal``)
_TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.IDLE, "forward"): Phase.FORWARD,
    (Phase.FORWARD, "forward"): Phase.FORWARD,
    (Phase.BACKWARD_DONE, "forward"): Phase.BACKWARD_DONE,
    (Phase.IDLE, "backward"): Phase.BACKWARD_DONE,
    (Phase.FORWARD, "backward"): Phase.BACKWARD_DONE,
    (Phase.BACKWARD_DONE, "step"): Phase.IDLE,
    (Phase.IDLE, "load"): Phase.IDLE,
    (Phase.FORWARD, "load"): Phase.IDLE,
    (Phase.BACKWARD_DONE, "load"): Phase.IDLE,
}


class MicroStep:
    """The engine's phase. ``check(call)`` before the call does anything (raises when the
    call is not allowed now), ``done(call)`` after it succeeded."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def check(self, call: str, *, steps: int = 0, micro_steps: int = 0) -> None:
        if self.phase is Phase.CLOSED:
            raise EngineClosedError(
                f"engine.{call}() after engine.close(): the engine released its swap folders, "
                "pinned memory and threads; build a new one with zeroio.initialize (and "
                "load_checkpoint to continue)")
        if (self.phase, call) not in _TRANSITIONS and call in ("backward", "step"):
            raise EngineStateError(_refusal(call, steps, micro_steps))

    def done(self, call: str) -> None:
        self.phase = _TRANSITIONS.get((self.phase, call), self.phase)

    @contextlib.contextmanager
    def restart_on_failure(self):
        """An optimizer step that raises ends its accumulation window: rolled back, its
        gradients are discarded and the window's micro batches run again from ``forward``;
        refused, only a load continues (step_guard.[Note: atomic step]). Either way the next
        micro step starts from IDLE."""
        try:
            yield
        except BaseException:
            if self.phase is not Phase.CLOSED:
                self.phase = Phase.IDLE
            raise

    def close(self) -> None:
        self.phase = Phase.CLOSED

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED


def _refusal(call: str, steps: int, micro_steps: int) -> str:
    where = f"(global step {steps}, micro step {micro_steps})"
    if call == "step":
        return (f"engine.step() with no engine.backward() since the last step {where}: "
                "nothing would be stepped but the moments. Each micro step is "
                "loss = engine(batch); engine.backward(loss); engine.step()")
    return (f"engine.backward() called twice without engine.step() between {where}: each "
            "micro step takes one backward. Call engine.step() after each backward (it steps "
            "the optimizer every gradient_accumulation_steps micro steps), or add the losses "
            "and call backward once")
