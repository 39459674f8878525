"""Which CPU Adam kernel steps host optimizer state, and what that makes of the host gradient,
decided without importing torch: ``zeroio.estimate`` plans with these rules,
``optim/cpu_adam.py`` applies them in training, and the engine hands ``optim/cpu_adam.py`` to
the partitioners as the kernel ``shard/host_grads.py`` asks. The host-gradient 16-bit rule itself
is ``shard/host_rule.py`` (re-exported here)."""

from __future__ import annotations

from zeroio.config import overrides
from zeroio.shard.host_rule import host_grad_may_be_16bit  # noqa: F401 (re-exported)

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


__all__ = ["AUTO_MIN_NUMEL", "MODES", "host_grad_may_be_16bit", "mode", "planned"]
