"""The zeroio error hierarchy.

Every error zeroio raises on purpose derives from ``ZeroIOError``; each leaf
also subclasses the builtin a caller would naturally catch (a bad config is a
``ValueError``, a failed swap an ``OSError``, an over-budget request a
``MemoryError``). Messages carry the names and values needed to fix the cause:
a config key path, a file path, bytes needed vs bytes free.
"""

from __future__ import annotations


class ZeroIOError(Exception):
    """Root of every error zeroio raises on purpose."""


class ConfigError(ZeroIOError, ValueError):
    """A config key is unknown, mistyped, of the wrong type or inconsistent.

    ``key`` is the dotted key path (``zero_optimization.offload_param.device``)
    when one is known.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class SwapIOError(ZeroIOError, OSError):
    """Reading or writing swapped state failed (short read, crc mismatch, ENOSPC...)."""


class IntegrityError(SwapIOError):
    """Data read back does not match the checksum recorded when it was written."""


class CapacityError(ZeroIOError, MemoryError):
    """A budget (GPU, pinned CPU, NVMe, buffer pool) cannot hold what is asked of it."""


class ResidencyError(ZeroIOError, RuntimeError):
    """A tiered-store call does not fit a tensor's residency state (release
    without acquire, mark_dirty while another tier holds it, unknown name...)."""


class CheckpointError(ZeroIOError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, of a newer format or of another model."""


class StepFailedError(ZeroIOError, RuntimeError):
    """An optimizer step failed ([Note: atomic step] in zeroio/step_guard.py).

    ``rolled_back`` True: the engine's state is exactly as before the step (the error of a
    foreign cause, wrapped); rerun the accumulation window and step again. False: the step
    had begun changing state that cannot be restored, and the engine refuses forward,
    backward, step and save_checkpoint until a checkpoint is loaded. ``__cause__`` is the
    original error."""

    def __init__(self, message: str, *, rolled_back: bool = False):
        super().__init__(message)
        self.rolled_back = rolled_back


class NonFiniteGradientError(ZeroIOError, FloatingPointError):
    """The global gradient norm is inf or nan and no fp16 loss scaling can skip the step; the
    step is rolled back ([Note: atomic step] in zeroio/step_guard.py)."""


class HostStepError(ZeroIOError, RuntimeError):
    """The optimizer step running on the host-step worker thread (an overlapped step) failed;
    raised on the training thread by the next wait for it, the worker's error as its cause."""


class ConfigWarning(UserWarning):
    """A config key that can have no effect in the config it is in (e.g. a tiering budget
    with nothing offloaded to NVMe); the message names the key and why. Emitted once, by
    ``load_config``."""


class CapacityWarning(UserWarning):
    """Training state may not fit a tier, but the measurement is not sure enough to refuse
    (a host whose memory is plugged in as it is used); the message gives the numbers."""


class DistributedError(ZeroIOError, RuntimeError):
    """A collective or the process group is not in the state an operation needs."""


class RankFailedError(DistributedError):
    """A rank of a multi-rank run raised; carries that rank's traceback text."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback_text = tb


class EngineStateError(ZeroIOError, RuntimeError):
    """An engine call out of its order (``step`` with no ``backward`` since the last one, a
    second ``backward`` before ``step``): engine_state.[Note: the micro-step protocol]."""


class EngineClosedError(EngineStateError):
    """A call on an engine after ``engine.close()``."""


class NotServedImportError(ZeroIOError, ImportError):
    """A ``deepspeed`` module the facade does not serve (MoE, pipeline, inference, ...); the
    message names what zeroio offers instead (zeroio/deepspeed/unsupported.py)."""


class NotServedAttributeError(ZeroIOError, AttributeError):
    """A ``deepspeed`` name the facade does not serve; the message names what zeroio offers."""


__all__ = [
    "ZeroIOError",
    "ConfigError",
    "SwapIOError",
    "IntegrityError",
    "CapacityError",
    "ResidencyError",
    "ConfigWarning",
    "CapacityWarning",
    "CheckpointError",
    "StepFailedError",
    "NonFiniteGradientError",
    "HostStepError",
    "DistributedError",
    "RankFailedError",
    "EngineStateError",
    "EngineClosedError",
    "NotServedImportError",
    "NotServedAttributeError",
]
