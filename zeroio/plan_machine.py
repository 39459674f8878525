"""The machine the placement planner plans for (zeroio/plan.py): one node's memory, disk and
speeds, from a JSON file (``zeroio estimate --plan --machine``) or the caller's figures."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from zeroio import jsonlimits
from zeroio.config.fields import did_you_mean
from zeroio.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Machine:
    """One node as the planner sees it. Bytes and bytes per second (GB = 1e9)."""

    gpus: int
    """GPUs (ranks) on the node."""
    gpu_bytes: int
    """Memory of one GPU."""
    host_bytes: int
    """Host memory training may use on the node (pinned buffers included)."""
    disk_bytes: int
    """Free bytes of the file system under the NVMe path (0: no disk)."""
    pcie_bps: float
    """Host <-> GPU bandwidth of one GPU, each direction."""
    disk_read_bps: float
    """Read bandwidth of the NVMe path, for the whole node."""
    disk_write_bps: float
    """Write bandwidth of the NVMe path, for the whole node."""
    cpu_adam_elems_per_s: float
    """Elements the host's CPU Adam updates per second, all cores of the node together."""
    disk_mixed_bps: float | None = None
    """Bytes per second read and written together while the disk does both at once (the NVMe
    step's pattern), for the whole node; None: not measured (the step time then counts the
    reads and the writes one after the other). Optional in a machine file."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _OPTIONAL:
                continue
            low = 0 if f.name == "disk_bytes" else 1
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v < low:
                raise ConfigError(f"machine.{f.name} = {v!r}: expected a number >= {low} "
                                  f"({_UNITS[f.name]})", key=f"machine.{f.name}")
            if f.name in ("gpus", "gpu_bytes", "host_bytes", "disk_bytes"):
                if v != int(v):
                    raise ConfigError(f"machine.{f.name} = {v!r}: expected a whole number "
                                      f"({_UNITS[f.name]})", key=f"machine.{f.name}")
                object.__setattr__(self, f.name, int(v))

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "machine") -> Machine:
        """A machine from a JSON object with exactly the field names above."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source} must hold a JSON object with the keys "
                              f"{', '.join(_UNITS)}", key="machine")
        known = [f.name for f in fields(cls)]
        for key in raw:
            if key not in known:
                raise ConfigError(f"{source}: unknown key machine.{key}{did_you_mean(key, known)}"
                                  f"; expected {', '.join(known)}", key=f"machine.{key}")
        missing = [k for k in known if k not in raw and k not in _OPTIONAL]
        if missing:
            raise ConfigError(f"{source}: missing machine.{missing[0]} ({_UNITS[missing[0]]})",
                              key=f"machine.{missing[0]}")
        return cls(**{k: raw[k] for k in known if k in raw})

    @classmethod
    def from_json(cls, path: str | Path) -> Machine:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--machine {p} does not exist; write a JSON object with the keys "
                              f"{', '.join(_UNITS)}", key="machine")
        try:
            raw = jsonlimits.loads(p.read_text(encoding="utf-8"), f"--machine {p}")
        except jsonlimits.JSONLimitError as e:
            raise ConfigError(str(e), key="machine") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"--machine {p} is not a JSON file: {e}", key="machine") from None
        return cls.from_dict(raw, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_UNITS = {"gpus": "GPUs per node", "gpu_bytes": "bytes per GPU",
          "host_bytes": "usable host bytes per node", "disk_bytes": "free bytes under the NVMe path",
          "pcie_bps": "bytes/s per GPU each way", "disk_read_bps": "bytes/s",
          "disk_write_bps": "bytes/s", "cpu_adam_elems_per_s": "elements/s per node",
          "disk_mixed_bps": "bytes/s read + written together, optional"}
_OPTIONAL = ("disk_mixed_bps",)


__all__ = ["Machine"]
