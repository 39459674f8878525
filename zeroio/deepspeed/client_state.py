"""``client_state`` of DeepSpeed's ``save_checkpoint``, written as JSON.

zeroio checkpoints hold no pickles: ``client_state`` is stored as JSON. DeepSpeed
pickles it, so clients put tensors in it (Lightning's ``ModelCheckpoint`` state
holds ``best_model_score`` as a tensor) and dicts keyed by integers. The facade
encodes those as tagged JSON objects on save and decodes them on load, so the
client gets back what it saved:

- a tensor: ``{"__zeroio_tensor__": {"dtype", "shape", "bytes"}}`` (its raw bytes,
  base64, little-endian, from a CPU copy; it comes back on the CPU);
- a numpy array (numpy scalars become Python numbers): the same with ``"numpy": true``;
- a dict with a key that is not a string: ``{"__zeroio_items__": [[key, value], ...]}``;
- a tuple comes back as a list (JSON has no tuple).

Anything else that JSON cannot hold is a ``CheckpointError`` naming its place in the
state (``client_state['callbacks']['X']``).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from zeroio.errors import CheckpointError

TENSOR = "__zeroio_tensor__"
ITEMS = "__zeroio_items__"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor(t: torch.Tensor, *, numpy: bool = False) -> dict:
    host = t.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    out = {"dtype": _dtype_name(host.dtype), "shape": list(host.shape),
           "bytes": base64.b64encode(raw).decode("ascii")}
    if numpy:
        out["numpy"] = True
    return {TENSOR: out}


def _numpy(value: Any):
    """(is a numpy value, its encoding) without importing numpy where it is not loaded."""
    try:
        import numpy as np
    except ImportError:
        return False, None
    if isinstance(value, np.ndarray):
        return True, _tensor(torch.from_numpy(np.ascontiguousarray(value)), numpy=True)
    if isinstance(value, np.generic):
        return True, value.item()
    return False, None


def encode(value: Any, where: str = "client_state") -> Any:
    """``value`` as JSON values (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {ITEMS: [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
                        for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    known, out = _numpy(value)
    if known:
        return out
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a zeroio checkpoint cannot hold (it stores "
        "client_state as JSON, never a pickle): store numbers, strings, lists, dicts or tensors")


def _decode_tensor(spec: dict) -> Any:
    dtype = getattr(torch, spec["dtype"])
    raw = bytearray(base64.b64decode(spec["bytes"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(spec["shape"]).clone()
    return t.numpy() if spec.get("numpy") else t


def decode(value: Any) -> Any:
    """The inverse of ``encode``."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {TENSOR}:
        return _decode_tensor(value[TENSOR])
    if set(value) == {ITEMS}:
        return {_hashable(decode(k)): decode(v) for k, v in value[ITEMS]}
    return {k: decode(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
