"""Every value a load applies besides the state arrays, checked before anything changes.

[Note: verify every value before apply]
A manifest's crc says the file is what a writer wrote, not that the writer was zeroio or that
the values fit this engine: a manifest edited by hand and its crc recomputed, or a bug in
some writer, passes it. So before a load writes anything, every rank checks each value the
apply phase will set ([Note: verify, then apply] in reader.py), against the live engine it
will go into:

- the engine's counters: integers >= 0; the last gradient norm a finite number or null;
- the loss scaler: ``cur_scale`` a finite number > 0, and every other key the engine's scaler
  has of the same kind as its own (a number, a flag);
- the optimizer (with its states): one step count (an integer >= 0) per group, as many
  param groups as the engine has, and each hyper-parameter the apply would set of the kind
  the engine's group holds (``like``: a number stays a finite number, a flag a flag, a tuple
  a list of that length; a learning rate of "0.1" is refused);
- the LR scheduler (when loaded): an object each of whose keys the engine's scheduler state
  holds is like the live value, and none of which names an attribute that state leaves out
  (its optimizer);
- module buffers: a dtype from ``BUFFER_DTYPES`` (looked up, never ``getattr(torch, ...)``,
  which would hand "load" back as ``torch.load``), the live buffer's shape, and exactly that
  many elements' bytes of base64 (decoded here once, for the apply to copy);
- this rank's RNG states: the sizes and ranges this process's generators take (rng.check).

A value that fails is a one-line ``CheckpointError`` naming the manifest and the key path
(``scalars.optimizer.param_groups[0].lr``); every rank then raises and the engine is exactly
as it was. Keys the apply ignores (a buffer the model no longer has, a hyper-parameter the
engine's group lacks) are not checked, as they are not applied.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroio.checkpoint import rng
from zeroio.errors import CheckpointError

BUFFER_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool)}
"""The dtypes a module buffer is saved and loaded in (by name, as the manifest holds it)."""

COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")


@dataclass
class Checked:
    """What the checks decoded, for the apply phase to set without decoding again."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Module buffer name -> its loaded value (a CPU tensor of the live buffer's shape)."""


class _Bad(ValueError):
    """A value that fails its check: ``key`` is its path, the message says why."""

    def __init__(self, key: str, why: str):
        super().__init__(why)
        self.key = key


def check_scalars(engine, manifest, rank_scalars: dict, *, load_optimizer_states: bool,
                  load_lr_scheduler_states: bool) -> Checked:
    """[Note: verify every value before apply]: raise the CheckpointError of the first value
    the load would apply to ``engine`` that does not fit, else return what was decoded."""
    s = manifest.scalars
    try:
        _counters(s.get("engine"))
        _loss_scaler(s.get("loss_scaler"), engine.loss_scaler.state_dict())
        if load_optimizer_states:
            _optimizer(s.get("optimizer"), engine)
        sched = engine.lr_scheduler
        if load_lr_scheduler_states and sched is not None and hasattr(sched, "state_dict") \
                and s.get("lr_scheduler") is not None:
            _dict_like(s["lr_scheduler"], sched.state_dict(), "scalars.lr_scheduler",
                       owner=sched)
        checked = Checked(buffers=_buffers(s.get("buffers") or {}, engine.module))
        if rank_scalars.get("rng") is not None:
            try:
                rng.check(rank_scalars["rng"])
            except ValueError as e:
                raise _Bad("rank_scalars.rng", str(e)) from None
    except _Bad as e:
        raise CheckpointError(
            f"checkpoint {manifest.path}: {e.key} {e}; the manifest was damaged, edited or "
            "written for another engine, and nothing was loaded (the engine is unchanged)"
        ) from None
    return checked


def _counters(e: Any) -> None:
    if not isinstance(e, dict):
        raise _Bad("scalars.engine", "is missing")
    for k in COUNTERS:
        v = e.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _Bad(f"scalars.engine.{k}", f"is {v!r}, not an integer >= 0")
    norm = e.get("last_grad_norm")
    if norm is not None and not _number(norm):
        raise _Bad("scalars.engine.last_grad_norm", f"is {norm!r}, not a finite number")


def _loss_scaler(saved: Any, live: dict) -> None:
    key = "scalars.loss_scaler"
    if not isinstance(saved, dict):
        raise _Bad(key, f"is {_shown(saved)}, not an object")
    scale = saved.get("cur_scale")
    if not _number(scale) or scale <= 0:
        raise _Bad(f"{key}.cur_scale", f"is {scale!r}, not a finite number > 0")
    for k, v in saved.items():
        if k in live:
            like(v, live[k], f"{key}.{k}")


def _optimizer(opt: Any, engine) -> None:
    key = "scalars.optimizer"
    if not isinstance(opt, dict):
        raise _Bad(key, "is missing")
    steps, groups = opt.get("steps"), opt.get("param_groups")
    n = len(engine.partitioner.groups)
    if not isinstance(steps, list) or len(steps) != n:
        raise _Bad(f"{key}.steps", f"is {_shown(steps)}, not one step count per group ({n}); "
                   "load with load_optimizer_states=False")
    for i, v in enumerate(steps):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _Bad(f"{key}.steps[{i}]", f"is {v!r}, not an integer >= 0")
    live_groups = engine.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        raise _Bad(f"{key}.param_groups", f"is {_shown(groups)}, not {len(live_groups)} "
                   "param groups (the engine's)")
    for i, (saved, live) in enumerate(zip(groups, live_groups, strict=True)):
        if not isinstance(saved, dict):
            raise _Bad(f"{key}.param_groups[{i}]", f"is {_shown(saved)}, not an object")
        for k, v in saved.items():
            if k in live and k != "params" and not callable(live[k]):
                like(v, live[k], f"{key}.param_groups[{i}].{k}")


def _buffers(saved: Any, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    if not isinstance(saved, dict):
        raise _Bad("scalars.buffers", f"is {_shown(saved)}, not an object")
    live = dict(module.named_buffers())
    out = {}
    for name, b in saved.items():
        if name not in live:
            continue  # not applied
        key = f"scalars.buffers[{name!r}]"
        if not isinstance(b, dict):
            raise _Bad(key, f"is {_shown(b)}, not an object")
        dtype = BUFFER_DTYPES.get(b.get("dtype")) if isinstance(b.get("dtype"), str) else None
        if dtype is None:
            raise _Bad(f"{key}.dtype", f"is {b.get('dtype')!r}, not one of {sorted(BUFFER_DTYPES)}")
        shape = list(live[name].shape)
        if b.get("shape") != shape:
            raise _Bad(f"{key}.shape", f"is {_shown(b.get('shape'))}, the model's buffer {shape}")
        try:
            raw = base64.b64decode(b.get("data", "").encode("ascii"), validate=True)
        except (AttributeError, UnicodeEncodeError, binascii.Error):
            raise _Bad(f"{key}.data", "is not base64 text") from None
        want = live[name].numel() * dtype.itemsize
        if len(raw) != want:
            raise _Bad(f"{key}.data", f"holds {len(raw)} bytes, {shape} of {b['dtype']} is {want}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def like(saved: Any, live: Any, key: str) -> None:
    """``saved`` can stand where the engine holds ``live``: a finite number for a number, a
    flag for a flag, a string for a string, a list as long as a list or tuple (element by
    element), an object for a dict (each key the live one has), any scalar for null."""
    if isinstance(live, torch.Tensor):
        live = live.tolist()
    if live is None:  # unset in the engine (torch's foreach, fused): any scalar sets it
        ok = saved is None or isinstance(saved, (bool, str)) or _number(saved)
    elif isinstance(live, bool):
        ok = isinstance(saved, bool)
    elif isinstance(live, (int, float)):
        ok = _number(saved)
    elif isinstance(live, str):
        ok = isinstance(saved, str)
    elif isinstance(live, (list, tuple)):
        ok = isinstance(saved, list) and len(saved) == len(live)
        for i, (a, b) in enumerate(zip(saved, live, strict=False) if ok else ()):
            like(a, b, f"{key}[{i}]")
    elif isinstance(live, dict):
        _dict_like(saved, live, key)
        return
    else:
        return  # an object the manifest cannot hold: the apply leaves it to its owner
    if not ok:
        raise _Bad(key, f"is {_shown(saved)}, the engine holds {_shown(live)}")


def _dict_like(saved: Any, live: dict, key: str, *, owner: object = None) -> None:
    """Each key of ``saved`` that ``live`` has is ``like`` it. ``owner``: the object whose
    ``state_dict()`` ``live`` is; a key its state lacks but the object has is refused (a
    torch scheduler's ``load_state_dict`` sets every key as an attribute, so "optimizer"
    would replace its optimizer); other keys (an older torch's) set nothing it uses."""
    if not isinstance(saved, dict):
        raise _Bad(key, f"is {_shown(saved)}, not an object")
    for k, v in saved.items():
        if k in live:
            like(v, live[k], f"{key}.{k}")
        elif owner is not None and hasattr(owner, str(k)):
            raise _Bad(f"{key}.{k}", f"would replace the engine's {type(owner).__name__}.{k}, "
                       f"which its state does not hold (its keys: {', '.join(sorted(live))})")


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _shown(v: Any) -> str:
    """``v`` and its JSON kind, short, for a message."""
    kind = {bool: "flag", int: "number", float: "number", str: "string", list: "list",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)
    text = repr(v)
    return f"{text[:40] + '...' if len(text) > 40 else text} ({kind})"


__all__ = ["BUFFER_DTYPES", "Checked", "check_scalars", "like"]
