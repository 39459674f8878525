"""The only module of the partition layer that calls torch.distributed.

Every collective is a free function taking explicit tensors and group and
returning a ``CommHandle`` that carries the work object; the consumer calls
``wait()``. With NCCL the collective runs on the process group's own stream
(``async_op=True``), so it overlaps the compute stream until ``wait()`` makes
the current stream wait on it; with gloo the work runs on gloo's threads.

[Note: gloo fallbacks]
gloo has no reduce-scatter and (depending on the build) no
``all_gather_into_tensor``. The fallbacks here keep the same in-place
contract: ``reduce_scatter_inplace`` all-reduces the whole bucket (the
caller reads only its slice), ``all_gather_inplace`` gathers into a list of
slices of the same buffer. Only this module knows which backend runs.

[Note: naming the rank that stopped answering]
A collective whose peer is stopped (SIGSTOP, a hung host) or gone fails after
the process group's timeout (``distributed.timeout_s``) with the backend's
words only ("Timed out waiting 5000ms for recv"), and the group is unusable
afterwards. So every wait here turns such a failure into a
``DistributedError`` that names the ranks: the failing rank writes
``zeroio/peer_check/<rank>`` into the rendezvous store and waits a few
seconds for every other rank's key. A live rank reaches the same point (its
own collective times out too); a stopped or dead one never does, and is named.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroio.errors import DistributedError
from zeroio.tiering.copies import Copies

# backend words of a peer that stopped answering or went away (gloo and NCCL)
_PEER_LOST = ("timed out", "timeout", "closed by peer", "reset by peer", "connection refused",
              "broken pipe", "pair closure")
_PEER_CHECK_S = 5.0


#: Reduction names the callers use (``op="min"``); a ``dist.ReduceOp`` is accepted as well.
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
        "product": dist.ReduceOp.PRODUCT}


@dataclass(frozen=True)
class World:
    """This process's place in the process group (or ``group``): a world of 1 when none is
    joined. ``backend`` is None then."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"


def is_initialized() -> bool:
    """Whether a process group is joined (False where torch has no distributed support)."""
    return dist.is_available() and dist.is_initialized()


def backend(group=None) -> str | None:
    """The process group's backend ("nccl", "gloo"), None when none is joined."""
    return str(dist.get_backend(group)) if is_initialized() else None


def world(group=None) -> World:
    """``World`` of the joined process group (or ``group``)."""
    if not is_initialized():
        return World()
    return World(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                 backend=str(dist.get_backend(group)))


_MADE_WORLD: list[object] = []
"""The default group when zeroio created it (``init_world``), else empty."""


def init_world(backend: str, timeout_s: float, **kwargs) -> None:
    """``init_process_group`` with every collective's timeout (``distributed.timeout_s``)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    _MADE_WORLD[:] = [dist.group.WORLD]


def init_local_world(timeout_s: float) -> None:
    """A gloo world of one process over an in-memory store (no launcher, no port)."""
    init_world("gloo", timeout_s, store=dist.HashStore(), rank=0, world_size=1)


_SIDE_GROUPS: dict[int, object] = {}
"""The world's side group (``side_group``), by ``id`` of the default group it shadows."""


def side_group(group=None):
    """A second process group over the same ranks as the world, for collectives a worker
    thread issues while the training thread may issue its own ([Note: step collectives] in
    partition/stage12_step.py): collectives of two groups never interleave on one another's
    connection, so a rank's own all-reduce of a loss cannot pair with another rank's
    all-gather. One per joined world, made on first use (every rank of the world must ask,
    in the same order: the partitioners ask at construction). ``group`` other than None (a
    subgroup: its non-members would not ask) and worlds of 1 get ``group`` back."""
    if group is not None or world_size() == 1:
        return group
    key = id(dist.group.WORLD)
    if key not in _SIDE_GROUPS:
        _SIDE_GROUPS[key] = dist.new_group(backend=dist.get_backend())
    return _SIDE_GROUPS[key]


def destroy_world() -> None:
    """Leave the process group, if one is joined."""
    _SIDE_GROUPS.clear()
    _MADE_WORLD.clear()
    if is_initialized():
        dist.destroy_process_group()


_WORKER_GRACE_S = 0.25
"""How long the exit waits, the GIL released, for the backend's workers to drop finished
collectives (``release_at_exit``)."""


def release_at_exit() -> None:
    """At interpreter exit, once every engine is closed (zeroio/shutdown.py, [Note: a clean
    exit]): leave zeroio's side groups and the world its engines ran on, whoever made it.

    A world left joined at finalization can abort the process: a gloo worker drops its last
    reference to a finished collective (the overlapped host step's last all-gather, a script's
    last ``accelerator.gather``) just after the waiting thread moved on, and that drop takes
    the GIL to free the tensors' Python objects; during finalization taking the GIL ends the
    thread with ``pthread_exit``, whose unwind through gloo's C++ frames calls
    ``std::terminate``. Leaving the world joins the backend's workers with the GIL released,
    but only once nothing else holds the group: a model still alive at exit (a script's
    ``Accelerator`` keeps its prepared models) holds it through its hooks, and then
    ``destroy_process_group`` leaves the workers running. So the world is left and then this
    thread waits ``_WORKER_GRACE_S`` with the GIL released: a worker that is still to drop a
    finished collective does it now, while the interpreter is whole (on a loaded machine a
    worker can wait tens of milliseconds for a core: 3 exits in about 70 of accelerate's
    config-file route aborted without the wait)."""
    _SIDE_GROUPS.clear()
    _MADE_WORLD.clear()
    if is_initialized():
        dist.destroy_process_group()  # every group, side groups included
        time.sleep(_WORKER_GRACE_S)


def _op(op) -> object:
    if isinstance(op, str):
        try:
            return _OPS[op]
        except KeyError:
            raise ValueError(f"reduction {op!r}: expected one of {', '.join(_OPS)}") from None
    return op


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in _PEER_LOST)


def silent_ranks(wait_s: float = _PEER_CHECK_S) -> list[int] | None:
    """Ranks that did not report within ``wait_s`` (see [Note: naming the rank that stopped
    answering]); None when the rendezvous store cannot be reached either."""
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(f"zeroio/peer_check/{me}", str(os.getpid()))
        pending = [r for r in range(world) if r != me]
        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not store.check([f"zeroio/peer_check/{r}"])]
            if pending:
                time.sleep(0.1)
        return pending
    except Exception:  # noqa: BLE001 - the store is as unreachable as the peers
        return None


def peer_error(exc: BaseException, op: str) -> BaseException:
    """``exc`` (a failed collective) as a ``DistributedError`` naming the silent ranks, or
    ``exc`` itself when it is not a lost peer."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, DistributedError) or \
            not is_initialized() or not _peer_lost(exc):
        return exc
    me = dist.get_rank()
    silent = silent_ranks()
    if silent is None:
        who = "the rendezvous store is unreachable too (its host, rank 0 or the launcher, stopped)"
    elif silent:
        who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
               f"stopped answering (no report within {_PEER_CHECK_S:g} s: stopped, hung or dead)")
    else:
        who = "every rank answered the peer check: one of them is slow or in another collective"
    return DistributedError(
        f"{op} failed on rank {me}: {who}. Backend said: {str(exc).strip()[:300]}. "
        "The wait is distributed.timeout_s in the config (zeroio train --timeout)")


def _guarded(op: str, fn: Callable[[], object]):
    try:
        return fn()
    except RuntimeError as e:
        err = peer_error(e, op)
        if err is e:
            raise
        raise err from e


@dataclass(eq=False)
class CommHandle:
    """An in-flight collective; ``wait()`` is idempotent and runs ``after`` once."""

    work: object | None
    after: Callable[[], None] | None = None
    _done: bool = field(default=False)
    op: str = "collective"

    def wait(self) -> None:
        if self._done:
            return
        if self.work is not None:
            _guarded(self.op, self.work.wait)
        if self.after is not None:
            self.after()
        self._done = True


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def all_reduce(tensor: torch.Tensor, group=None, op="sum") -> CommHandle:
    """Reduce ``tensor`` over ranks in place (``op``: sum, min, max, product), asynchronously."""
    if world_size(group) == 1:
        return CommHandle(None)
    return CommHandle(_guarded("all_reduce", lambda: dist.all_reduce(
        tensor, op=_op(op), group=group, async_op=True)), op="all_reduce")


def reduce_scatter_inplace(bucket: torch.Tensor, group=None) -> CommHandle:
    """Sum ``bucket`` over ranks; afterwards this rank's equal slice of it holds the sum.

    ``bucket.numel()`` must be a multiple of the world size. The other slices
    are left undefined (NCCL) or also reduced (gloo fallback)."""
    world = world_size(group)
    if world == 1:
        return CommHandle(None)
    if not _is_nccl(group):
        return CommHandle(_guarded("reduce_scatter", lambda: dist.all_reduce(
            bucket, group=group, async_op=True)), op="reduce_scatter")
    shard = bucket.numel() // world
    out = bucket.narrow(0, rank(group) * shard, shard)
    return CommHandle(_guarded("reduce_scatter", lambda: dist.reduce_scatter_tensor(
        out, bucket, group=group, async_op=True)), op="reduce_scatter")


def all_gather_inplace(buffer: torch.Tensor, group=None) -> CommHandle:
    """Fill ``buffer`` from every rank's equal slice of it (this rank's slice is the input)."""
    world = world_size(group)
    if world == 1:
        return CommHandle(None)
    shard = buffer.numel() // world
    mine = buffer.narrow(0, rank(group) * shard, shard)
    if _is_nccl(group):
        return CommHandle(_guarded("all_gather", lambda: dist.all_gather_into_tensor(
            buffer, mine, group=group, async_op=True)), op="all_gather")
    # gloo: a private copy of the input, since the outputs alias it (see [Note: gloo fallbacks])
    outs = list(buffer.split(shard))
    return CommHandle(_guarded("all_gather", lambda: dist.all_gather(
        outs, mine.clone(), group=group, async_op=True)), op="all_gather")


def all_reduce_scalar(value: torch.Tensor, group=None, op="sum") -> torch.Tensor:
    """Blocking all-reduce in place (norms, flags, small tables; ``op`` as for ``all_reduce``);
    returns ``value``."""
    if world_size(group) > 1:
        _guarded("all_reduce", lambda: dist.all_reduce(value, op=_op(op), group=group))
    return value


def reduce(tensor: torch.Tensor, dst: int = 0, group=None, op="sum") -> torch.Tensor:
    """Blocking reduce onto global rank ``dst`` (the others' ``tensor`` is undefined after);
    returns ``tensor``."""
    if world_size(group) > 1:
        _guarded("reduce", lambda: dist.reduce(tensor, dst=dst, op=_op(op), group=group))
    return tensor


def broadcast_bytes(data: bytes | None, src: int = 0, group=None,
                    device: torch.device | None = None) -> bytes:
    """Rank ``src``'s ``data`` on every rank (a length, then a uint8 tensor on ``device``: the
    CUDA device under NCCL); other ranks' ``data`` is ignored. No pickle."""
    if world_size(group) == 1:
        return data or b""
    mine = (data or b"") if rank() == src else b""
    n = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    broadcast(n, src, group).wait()
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    moves = Copies(None)  # a checkpoint's metadata text, not training state: uncounted
    if rank() == src and mine:
        moves.into(buf, torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    if buf.numel():
        broadcast(buf, src, group).wait()
    return bytes(moves.host(buf).numpy())


def broadcast(tensor: torch.Tensor, src: int, group=None) -> CommHandle:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (global rank), asynchronously."""
    if world_size(group) == 1:
        return CommHandle(None)
    return CommHandle(_guarded("broadcast", lambda: dist.broadcast(
        tensor, src=src, group=group, async_op=True)), op="broadcast")


def barrier(group=None) -> None:
    """Wait for every rank (a lost peer is named, as for every collective here)."""
    if world_size(group) > 1:
        _guarded("barrier", lambda: dist.barrier(group=group))


# ---- collectives a client script calls (deepspeed.comm) ------------------------------------
#
# [Note: client collectives]
# A script written for DeepSpeed calls ``deepspeed.comm.all_reduce(t)`` and friends on its own
# tensors (a loss to average, a metric to sum). They are torch.distributed's collectives with
# torch's signatures; they pass through here so that this module stays the one caller of
# torch.distributed, a lost peer is named as for zeroio's own collectives, and gloo gets what
# it lacks: ``reduce_scatter_tensor`` / ``reduce_scatter`` (an all-reduce of the whole input,
# this rank's part copied out), ``all_gather_into_tensor`` (a list gather into views of the
# output) and ``ReduceOp.AVG`` (a sum, divided by the group's size). ``async_op=True`` returns
# a ``CommHandle`` (``wait()``), else the call has finished when it returns.

ReduceOp = dist.ReduceOp
CLIENT_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
              "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all",
              "gather", "scatter", "send", "recv", "barrier", "all_gather_object",
              "broadcast_object_list")
"""The torch.distributed collectives ``client_op`` runs."""


def _finish(work, op: str, async_op: bool, after: Callable[[], None] | None = None):
    handle = CommHandle(work, after=after, op=op)
    if async_op:
        return handle
    handle.wait()
    return None


def _is_avg(op) -> bool:
    return op is dist.ReduceOp.AVG or op == dist.ReduceOp.AVG or op == "avg"


def _gloo_avg(name: str, args: tuple, kwargs: dict, group) -> tuple[tuple, dict, object]:
    """(args, kwargs, op) with AVG turned into SUM where gloo runs the reduction; the caller
    divides the result by the group's size."""
    op = kwargs.get("op", dist.ReduceOp.SUM)
    if not _is_avg(op) or _is_nccl(group):
        return args, kwargs, None
    return args, dict(kwargs, op=dist.ReduceOp.SUM), op


def _reduce_scatter_gloo(output: torch.Tensor, chunks: list[torch.Tensor], op, group,
                         async_op: bool):
    """gloo has no reduce-scatter: all-reduce a concatenation, copy this rank's chunk out."""
    whole = torch.cat([c.reshape(-1) for c in chunks])
    work = _guarded("reduce_scatter", lambda: dist.all_reduce(
        whole, op=_op(op), group=group, async_op=True))
    lo = sum(c.numel() for c in chunks[:rank(group)])

    def copy_out() -> None:
        output.copy_(whole.narrow(0, lo, output.numel()).view_as(output))
    return _finish(work, "reduce_scatter", async_op, copy_out)


def client_op(name: str, *args, async_op: bool = False, **kwargs):
    """``torch.distributed.<name>(*args, **kwargs)`` for a client script ([Note: client
    collectives]); ``name`` one of ``CLIENT_OPS``."""
    if name not in CLIENT_OPS:
        raise ValueError(f"collective {name!r}: expected one of {', '.join(CLIENT_OPS)}")
    group = kwargs.get("group")
    if not is_initialized():
        raise DistributedError(f"deepspeed.comm.{name}: no process group is joined; call "
                               "deepspeed.init_distributed() first")
    if name in ("reduce_scatter_tensor", "reduce_scatter") and not _is_nccl(group):
        output, source = args[0], args[1]
        chunks = list(source.chunk(world_size(group))) if name == "reduce_scatter_tensor" \
            else list(source)
        op = kwargs.get("op", dist.ReduceOp.SUM)
        avg = _is_avg(op)
        out = _reduce_scatter_gloo(output, chunks, dist.ReduceOp.SUM if avg else op, group,
                                   async_op=False)
        if avg:
            output.div_(world_size(group))
        return CommHandle(None) if async_op else out
    if name == "all_gather_into_tensor" and not _is_nccl(group):
        output, source = args[0], args[1]
        views = list(output.reshape(-1).chunk(world_size(group)))
        work = _guarded(name, lambda: dist.all_gather(views, source.reshape(-1).clone(),
                                                       group=group, async_op=True))
        return _finish(work, name, async_op)
    args, kwargs, avg = _gloo_avg(name, args, kwargs, group)
    fn = getattr(dist, name)
    if name in ("all_gather_object", "broadcast_object_list"):  # no async form in torch
        _guarded(name, lambda: fn(*args, **kwargs))
        return CommHandle(None) if async_op else None
    work = _guarded(name, lambda: fn(*args, **kwargs, async_op=True))
    after = (lambda: args[0].div_(world_size(group))) if avg is not None else None
    return _finish(work, name, async_op, after)


def new_group(ranks=None, **kwargs):
    """``torch.distributed.new_group`` (every rank of the world calls it)."""
    return dist.new_group(ranks, **kwargs)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s member ``group_rank``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def group_ranks(group=None) -> list[int]:
    """The global ranks in ``group`` (None: the world)."""
    if group is None or not is_initialized():
        return list(range(world_size()))
    return dist.get_process_group_ranks(group)


def world_group():
    """The default process group (``dist.group.WORLD``)."""
    return dist.group.WORLD


def destroy_group(group) -> None:
    """Leave one process group (``destroy_world`` leaves them all)."""
    dist.destroy_process_group(group)
