"""Settings of the I/O engine: DeepSpeed's ``aio`` block, keys and meanings.

``EngineSettings.resolve`` accepts the config layer's ``cfg.aio`` object (any
object with those attributes) and/or plain keyword arguments, so the engine
works before and without the config layer. Keyword arguments win.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from zeroio.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    block_size: int = 1048576
    """Bytes per I/O request; a transfer is split into requests of this size."""
    queue_depth: int = 8
    """Requests in flight per thread: each syscall carries up to this many
    block_size requests (one ``preadv``/``pwritev`` with that many iovecs)."""
    thread_count: int = 1
    """Worker threads (DeepSpeed ``intra_op_parallelism``, alias ``thread_count``)."""
    single_submit: bool = False
    """Submit one block per syscall instead of ``queue_depth`` at once."""
    overlap_events: bool = True
    """Accepted for DeepSpeed compatibility: the thread pool always overlaps
    submission and completion, so this has no further effect."""
    use_gds: bool = False
    """GPUDirect Storage; not available in this backend (warns, uses the host path)."""
    direct: bool | None = None
    """O_DIRECT: None = use it where the filesystem supports it, False = never."""

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"aio.{name} must be a positive integer, got {v!r}", key=f"aio.{name}")
        if self.block_size % 4096:
            raise ConfigError(
                f"aio.block_size must be a multiple of 4096 for direct I/O, got {self.block_size}",
                key="aio.block_size",
            )

    @classmethod
    def resolve(cls, aio_cfg: object | None = None, **overrides: object) -> EngineSettings:
        values: dict[str, object] = {}
        if aio_cfg is not None:
            if isinstance(aio_cfg, EngineSettings):
                values.update({f.name: getattr(aio_cfg, f.name) for f in fields(cls)})
            else:
                src = aio_cfg if isinstance(aio_cfg, dict) else vars_of(aio_cfg)
                for key, value in src.items():
                    name = "thread_count" if key == "intra_op_parallelism" else key
                    if name in {f.name for f in fields(cls)} and value is not None:
                        values[name] = value
        for key, value in overrides.items():
            name = "thread_count" if key == "intra_op_parallelism" else key
            if name not in {f.name for f in fields(cls)}:
                raise ConfigError(f"IOEngine: unknown setting {key!r}", key=f"aio.{key}")
            if value is not None:
                values[name] = value
        return replace(cls(), **values)


def vars_of(obj: object) -> dict[str, object]:
    """Attributes of a config object (dataclass, namespace or plain object)."""
    names = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count",
             "single_submit", "overlap_events", "use_gds")
    return {n: getattr(obj, n) for n in names if hasattr(obj, n)}
