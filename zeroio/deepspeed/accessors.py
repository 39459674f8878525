"""``deepspeed.utils.safe_get_full_fp32_param`` and friends: a parameter's full fp32 master,
gradient or optimizer state, read from (or written into) zeroio's partitioned state.

[Note: full-parameter accessors]
Every rank holds some elements of each parameter's master, gradient and moments (the
ShardGroup segments of the global flat order, [Note: global flat order] in shard/types.py).
A ``safe_get_*`` call is collective, as DeepSpeed's: each rank writes the elements it holds
into a zero tensor of the parameter's size (stage 0: rank 0 only, every rank holds all), one
all-reduce sums them, and every rank gets the whole tensor, shaped as the parameter, on the
engine's device. The values are read where the optimizer keeps them (host, GPU, a ratio
split, NVMe pieces) through the same calls a checkpoint uses (``read_local`` or
``local_tensor``), after an overlapped step has finished. A ``safe_set_*`` call (also
collective, every rank passing the same value) writes each rank's elements; setting the
master republishes the 16-bit parameters at once (DeepSpeed leaves them until the next
step: here the next forward already sees the value).

Gradients exist between ``engine.backward(loss)`` at the accumulation boundary and
``engine.step()`` (the averaged gradient the step will use, loss scale removed); asked at
another time, ``safe_get_full_grad`` raises, naming when to call it. A parameter the
optimizer does not train (frozen) has none of these: the getters return None, as
DeepSpeed's. A parameter of no engine raises, naming ``deepspeed.initialize``.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zeroio.errors import EngineStateError
from zeroio.partition import collectives

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> (zeroio engine, name in the global flat order)."""


def register(engine) -> None:
    """Map each parameter of ``engine.module`` (a zeroio ``Engine``) to it (tied: one name)."""
    for name, p in engine.module.named_parameters():
        _OWNERS[p] = (engine, name)


def _owner(param):
    found = _OWNERS.get(param)
    if found is None:
        raise ValueError("this parameter belongs to no zeroio engine: pass a parameter of the "
                         "model given to deepspeed.initialize (engine.module.parameters())")
    return found


def _entry(engine, name: str):
    for e in engine.partitioner.index.entries:
        if e.name == name:
            return e
    raise KeyError(name)


def _ranges(engine, entry):
    """(group index, local offset, element offset within the parameter, elements) for each
    run of ``entry``'s elements this rank holds."""
    lo, hi = entry.offset, entry.offset + entry.numel
    if engine.partitioner.stage == 0 and collectives.rank(engine.partitioner.group) != 0:
        return
    for g in engine.partitioner.groups:
        for s in g.segments:
            a, b = max(lo, s.global_offset), min(hi, s.global_offset + s.numel)
            if a < b:
                yield g.group_index, s.local_offset + a - s.global_offset, a - lo, b - a


def _read_state(engine, gi: int, kind: str, lo: int, n: int) -> torch.Tensor:
    opt = engine.optimizer
    if opt.reads_ranges:
        return opt.read_local(gi, kind, lo, n)
    return opt.local_tensor(gi, kind).narrow(0, lo, n)


def _physical(engine, gi: int, lo: int, n: int):
    """(gradient tensor, offset) pieces of group ``gi``'s local range [lo, lo + n): the
    group's own gradient, or with a ratio split the device part then the host part."""
    split = engine.partitioner.optimizer_split
    if split is None:
        yield engine.partitioner.groups[gi].grad, lo, n
        return
    dev, host = split.device[gi], split.host[gi]
    d = dev.padded_numel
    if lo < d:
        yield dev.grad, lo, min(n, d - lo)
    if lo + n > d:
        start = max(lo, d)
        yield host.grad, start - d, lo + n - start


def _read_grad(engine, gi: int, lo: int, n: int) -> torch.Tensor:
    divisor = engine.partitioner.host_grad_divisor  # stage 1/2's unaveraged 16-bit host grads
    parts = []
    for grad, at, k in _physical(engine, gi, lo, n):
        part = grad.narrow(0, at, k).float()
        parts.append(part / divisor if grad.dtype != torch.float32 else part)
    return torch.cat([p.to("cpu") for p in parts]) / engine.loss_scaler.scale


def _comm_device(engine) -> torch.device:
    return engine.device if collectives.backend() == "nccl" else torch.device("cpu")


def _gather(engine, name: str, read) -> torch.Tensor | None:
    """The full tensor of parameter ``name`` from every rank's runs (``read(gi, lo, n)``)."""
    entry = _entry(engine, name)
    dev = _comm_device(engine)
    full = torch.zeros(entry.numel, dtype=torch.float32, device=dev)
    held = torch.zeros(1, dtype=torch.float64, device=dev)
    for gi, lo, at, n in _ranges(engine, entry):
        full[at:at + n] = read(gi, lo, n).to(device=dev, dtype=torch.float32)
        held += n
    group = engine.partitioner.group
    collectives.all_reduce_scalar(full, group)
    collectives.all_reduce_scalar(held, group)
    if held.item() == 0:
        return None  # in no optimizer group: frozen
    return full.view(entry.shape).to(engine.device)


def _settled(engine) -> None:
    engine.synchronize()  # an overlapped step writes masters and moments
    engine.partitioner.release_device_state()


def _check_kind(engine, kind: str) -> None:
    kinds = engine.optimizer.state_kinds
    if kind not in kinds:
        raise KeyError(f"optimizer state {kind!r}: zeroio's {engine.optimizer.rule_name} "
                       f"optimizer keeps {', '.join(kinds) or 'none'}")


def get_full_state(param, kind: str) -> torch.Tensor | None:
    """``kind`` "fp32" (the master) or one of the optimizer's state kinds, full (collective)."""
    engine, name = _owner(param)
    if kind != "fp32":
        _check_kind(engine, kind)
    _settled(engine)
    return _gather(engine, name, lambda gi, lo, n: _read_state(engine, gi, kind, lo, n))


def get_full_grad(param) -> torch.Tensor | None:
    """The averaged gradient the next optimizer step uses, full (collective)."""
    engine, name = _owner(param)
    if not engine.step_gradients_ready():
        raise EngineStateError(
            "safe_get_full_grad: the gradient exists between engine.backward(loss) at the "
            "accumulation boundary and engine.step() (is_gradient_accumulation_boundary() "
            "True); call it there")
    engine.partitioner.grads_to_host()
    return _gather(engine, name, lambda gi, lo, n: _read_grad(engine, gi, lo, n))


def _write_state(engine, gi: int, kind: str, lo: int, values: torch.Tensor) -> None:
    opt = engine.optimizer
    if opt.reads_ranges:
        opt.write_local_range(gi, kind, lo, values)
        return
    local = opt.local_tensor(gi, kind)
    local.narrow(0, lo, values.numel()).copy_(values)
    opt.write_local(gi, kind, local)  # state kept as a copy takes it back


def set_full_state(param, value: torch.Tensor, kind: str) -> None:
    """Write ``value`` (the full tensor) into this rank's elements of ``kind`` (collective:
    every rank passes the same value); "fp32" republishes the 16-bit parameters."""
    engine, name = _owner(param)
    if kind != "fp32":
        _check_kind(engine, kind)
    entry = _entry(engine, name)
    if value.numel() != entry.numel:
        raise ValueError(f"safe_set: {name} has {entry.numel} elements {tuple(entry.shape)}, "
                         f"the value {value.numel()} {tuple(value.shape)}")
    _settled(engine)
    flat = value.detach().reshape(-1).to("cpu", torch.float32)
    for gi, lo, at, n in _ranges(engine, entry):
        _write_state(engine, gi, kind, lo, flat[at:at + n])  # cast to the state's dtype there
    if kind == "fp32":
        engine.partitioner.publish_params()  # collective: the 16-bit parameters follow


# ---- DeepSpeed's names (deepspeed.utils, deepspeed/utils/tensor_fragment.py) -----------------

def safe_get_full_fp32_param(param) -> torch.Tensor | None:
    """The parameter's full fp32 master (collective: every rank calls it)."""
    return get_full_state(param, "fp32")


def safe_set_full_fp32_param(param, value) -> None:
    """Set the parameter's master (and so its 16-bit values) to ``value`` (collective)."""
    set_full_state(param, value, "fp32")


def safe_get_full_optimizer_state(param, optim_state_key) -> torch.Tensor | None:
    """The parameter's full optimizer state ``optim_state_key`` ("exp_avg", "exp_avg_sq")."""
    return get_full_state(param, optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key) -> None:
    set_full_state(param, value, optim_state_key)


def safe_get_full_grad(param) -> torch.Tensor | None:
    """The parameter's full averaged gradient, between backward at the boundary and step."""
    return get_full_grad(param)


__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_full_grad"]
