"""``zero.Init``: parameters partitioned as modules are created, without patching ``nn.Module``.

[Note: partition on registration]
``torch.nn.modules.module.register_module_parameter_registration_hook`` (a
public, removable hook; only installed inside the context) tells us each
module that registers a parameter. A module's ``__init__`` keeps running after
its parameters are registered (``nn.Linear`` calls ``reset_parameters`` last),
so a module is partitioned only once the construction has moved on: when a
*different* module registers a parameter, and at context exit. At that point
each of its new parameters is broadcast from rank 0 (every rank then holds
the same initial values, as a single-process model would), flattened, padded
to ``S*world`` elements, and this rank keeps elements ``[rank*S, (rank+1)*S)``
in ``registry.INIT_SHARDS``; the ``nn.Parameter`` (same object, so tying and
optimizer references stay valid) is left holding an empty placeholder. Peak
memory is therefore about one module's full parameters. The stage-3
partitioner later regroups these per-parameter shards into its flat groups,
one group at a time.

Initialisation code that runs after a module was partitioned (a parent's
``post_init``/``_init_weights`` in Hugging Face models) sees empty
placeholders and is a no-op; ``zero.Init`` redoes transformers' init module
by module (see [Note: Hugging Face init under zero.Init] in
zeroio/partition/zero.py). Other code re-initialises with
``GatheredParameters(..., modifier_rank=0)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from zeroio.partition import collectives as comm
from zeroio.partition.stage3 import registry
from zeroio.tiering.copies import Copies


def partition_param(p: nn.Parameter, *, group=None, src: int = 0,
                    dtype: torch.dtype | None = None) -> None:
    """Keep this rank's slice of ``p`` (broadcast from ``src`` first); leave ``p`` empty.

    The slice lives in host memory whatever device the parameter was built on
    (the partitioner later moves each group to its home). With one rank the
    parameter's own storage becomes the slice: no copy, no new allocation.
    """
    if p in registry.INIT_SHARDS or p in registry.OWNERS:
        return
    world, rank = comm.world_size(group), comm.rank(group)
    data = p.detach()
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    data = _collective_ready(data.contiguous(), group)
    comm.broadcast(data, src, group).wait()
    numel = data.numel()
    shard = max(1, -(-numel // world))
    flat = data.reshape(-1)
    if world == 1 and numel > 0:
        piece = _INIT_COPIES.to(flat, _HOST)
    else:
        piece = torch.zeros(shard, dtype=data.dtype, device=_HOST)
        lo, hi = min(numel, rank * shard), min(numel, (rank + 1) * shard)
        piece.narrow(0, 0, hi - lo).copy_(flat.narrow(0, lo, hi - lo))
    registry.INIT_SHARDS[p] = registry.InitShard(shape=tuple(p.shape), dtype=data.dtype,
                                                 numel=numel, shard=piece, world=world)
    p.data = torch.empty(0, dtype=data.dtype, device=p.device)


_HOST = torch.device("cpu")
_INIT_COPIES = Copies(None)
"""zero.Init's moves run while the model is built, before any engine holds stats to count
them into (engine.stats() counts from the engine's start)."""


def _collective_ready(t: torch.Tensor, group) -> torch.Tensor:
    """NCCL moves device tensors only: a host tensor goes to the current GPU for the collective."""
    if t.device.type == "cpu" and comm.world_size(group) > 1 and comm._is_nccl(group):
        return _INIT_COPIES.to(t, torch.device("cuda", torch.cuda.current_device()))
    return t


def gather_param(p: nn.Parameter, group=None, device: torch.device | None = None) -> torch.Tensor:
    """The full value of a parameter partitioned by ``partition_param`` (collective), on
    ``device`` (None: where the slice is; NCCL: the current GPU).

    With one rank on the slice's device this is a view of the slice itself (no
    copy); see ``write_back_param``.
    """
    rec = registry.INIT_SHARDS[p]
    n = rec.shard.numel()
    device = torch.device(device) if device is not None else rec.shard.device
    if rec.world == 1:
        return _INIT_COPIES.to(rec.shard.narrow(0, 0, rec.numel).view(rec.shape), device)
    full = torch.empty(n * rec.world, dtype=rec.dtype, device=device)
    full.narrow(0, comm.rank(group) * n, n).copy_(rec.shard)
    full = _collective_ready(full, group)
    comm.all_gather_inplace(full, group).wait()
    return full.narrow(0, 0, rec.numel).view(rec.shape)


def write_back_param(p: nn.Parameter, full: torch.Tensor, src: int, group=None) -> None:
    """``full`` (from ``gather_param``, possibly changed in place): broadcast ``src``'s values
    and store this rank's slice into the kept slice's own storage; ``p`` is left empty."""
    rec = registry.INIT_SHARDS[p]
    if full.data_ptr() != rec.shard.data_ptr():  # one rank: the view already is the slice
        flat = _collective_ready(full.contiguous().reshape(-1), group)
        comm.broadcast(flat, src, group).wait()
        n = rec.shard.numel()
        lo, hi = min(rec.numel, comm.rank(group) * n), min(rec.numel, (comm.rank(group) + 1) * n)
        rec.shard.narrow(0, 0, hi - lo).copy_(flat.narrow(0, lo, hi - lo))
    p.data = torch.empty(0, dtype=rec.dtype, device=p.device)


def param_from_file(reader, key: str, shape: tuple[int, ...], *, dtype: torch.dtype,
                    requires_grad: bool = True, group=None,
                    device: torch.device | None = None) -> nn.Parameter:
    """A new partitioned parameter of ``shape`` whose shard is read from ``key``.

    ``reader`` is a ``zeroio.io.safetensors_reader.SafetensorsReader``; only this
    rank's elements ``[rank*S, (rank+1)*S)`` of the flattened tensor are read
    (every rank reads its own range of the same file, so nothing is broadcast),
    then cast to ``dtype``. The parameter holds an empty placeholder on
    ``device`` (default: host), like one ``partition_param`` left.
    """
    world, rank = comm.world_size(group), comm.rank(group)
    numel = math.prod(shape)
    shard = max(1, -(-numel // world))
    lo, hi = min(numel, rank * shard), min(numel, (rank + 1) * shard)
    piece = torch.zeros(shard, dtype=reader.dtype(key), device=_HOST)
    reader.read_range(key, lo, hi - lo, out=piece.narrow(0, 0, hi - lo))
    if piece.dtype != dtype:
        piece = piece.to(dtype)
    device = device if device is not None else _HOST
    p = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                     requires_grad=requires_grad and dtype.is_floating_point)
    registry.INIT_SHARDS[p] = registry.InitShard(shape=tuple(shape), dtype=dtype,
                                                 numel=numel, shard=piece, world=world)
    return p


def repartition_param(p: nn.Parameter, src: int, group=None) -> None:
    """After a modifier rank changed ``p`` in place: broadcast it and keep the new slice."""
    registry.INIT_SHARDS.pop(p, None)
    partition_param(p, group=group, src=src)


def return_freed_memory() -> None:
    """Hand the heap pages freed by one module's full parameters back to the OS (glibc).

    After the first large block is freed, glibc raises its mmap threshold, so
    later full tensors (a module's parameters, gathered copies, gloo's buffers
    in its worker threads' arenas) come from heaps it does not trim; module
    after module the resident set would grow by about half the model instead
    of one module. ``malloc_trim`` releases the free pages of every arena.
    Elsewhere (no glibc): a no-op.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_TRIM: list = []


def _malloc_trim():
    if not _TRIM:
        fn = None
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        except OSError:
            fn = None
        _TRIM.append(fn)
    return _TRIM[0]


class PartitionOnCreate:
    """The mechanism of [Note: partition on registration]; ``zero.Init`` is its public face."""

    def __init__(self, *, group=None, dtype: torch.dtype | None = None, enabled: bool = True,
                 device: torch.device | None = None):
        self.group, self.dtype, self.enabled = group, dtype, enabled
        self.device = device
        """Where modules are built (their initialisers run there); None = torch's default."""
        self._pending: list[nn.Module] = []
        self.holding = False
        """While set, registered modules only queue (``flush`` partitions them later)."""
        self._handle = None
        self._device_ctx = None

    def _on_register(self, module: nn.Module, name: str, param):
        if param is None:
            return None
        if self._pending and self._pending[-1] is not module and not self.holding:
            self._flush(keep=module)
        if not self._pending or self._pending[-1] is not module:
            self._pending.append(module)
        return None

    def _flush(self, keep: nn.Module | None = None) -> None:
        still, flushed = [], False
        for m in self._pending:
            if m is keep:
                still.append(m)
                continue
            for p in list(m._parameters.values()):
                if p is not None and not p.is_meta:  # meta: from_pretrained fills it (pretrained.py)
                    partition_param(p, group=self.group, dtype=self.dtype)
            flushed = True
        self._pending = still
        if flushed and comm.world_size(self.group) > 1:  # one rank keeps the storage itself
            return_freed_memory()

    def flush(self) -> None:
        """Partition every queued module now."""
        self._flush()

    def __enter__(self):
        if self.enabled:
            self._handle = register_module_parameter_registration_hook(self._on_register)
            if self.device is not None:
                self._device_ctx = torch.device(self.device)
                self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            try:
                if exc[0] is None:
                    self._flush()
            finally:
                self._pending = []
                if self._device_ctx is not None:
                    self._device_ctx.__exit__(None, None, None)
                    self._device_ctx = None
        return False
