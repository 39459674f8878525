"""Which CPU Adam kernel steps host optimizer state, and what that makes of the host gradient,
decided without importing torch: ``zeroio.estimate`` plans with these rules,
``optim/cpu_adam.py`` and ``partition/host_grads.py`` apply them in training."""

from __future__ import annotations

from zeroio.config import overrides

AUTO_MIN_NUMEL = 1 << 24
"""``auto`` compiles for host optimizer state of at least this many elements (64 MB fp32)."""

MODES = overrides.CPU_ADAM_MODES


def mode() -> str:
    """``ZEROIO_CPU_ADAM``: auto (default), compiled or torch (a process override, read by
    the config layer: config/overrides.py)."""
    return overrides.cpu_adam_mode()


def planned(total_numel: int) -> bool:
    """Whether host optimizer state of ``total_numel`` elements is planned for the compiled
    one-pass kernel, from ``ZEROIO_CPU_ADAM`` and the size alone (``auto`` counts as compiling;
    nothing is compiled here)."""
    m = mode()
    return m == "compiled" or (m == "auto" and total_numel >= AUTO_MIN_NUMEL)


def host_grad_may_be_16bit(*, stage: int, half: bool, cpu_optimizer: bool,
                           accumulation_steps: int, host_numel: int) -> bool:
    """Whether the host gradient shard can stay in the 16-bit compute dtype (``half``), before
    the kernel choice: a CPU Adam steps a non-empty host shard, and nothing accumulates on the
    host (stage 1 always; stages 2 and 3 only with one micro step). It then is 16-bit exactly
    when the one-pass kernel steps it (partition/host_grads.py's module doc)."""
    host_accumulates = stage != 1 and accumulation_steps > 1
    return cpu_optimizer and host_numel > 0 and half and not host_accumulates


__all__ = ["AUTO_MIN_NUMEL", "MODES", "host_grad_may_be_16bit", "mode", "planned"]
