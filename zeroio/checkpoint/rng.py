"""RNG states as JSON (bytes as base64): torch CPU and CUDA, numpy, python `random`.

They are per rank (each rank's dropout stream differs), so they travel in
`ShardedState.rank_scalars`; a resume on another world size gives rank r the
state of rank r % N, which keeps runs reproducible though not identical to
an uninterrupted run on N ranks.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def capture() -> dict[str, Any]:
    """This process's RNG states, JSON-able."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch_cpu": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"kind": kind, "keys": _b64(np.asarray(keys, dtype=np.uint32).tobytes()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = _b64(torch.cuda.get_rng_state().numpy().tobytes())
    return out


def restore(state: dict[str, Any]) -> None:
    """Set this process's RNG states from `capture()`'s output (missing parts are left alone)."""
    if "torch_cpu" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(_unb64(state["torch_cpu"])), dtype=torch.uint8))
    if "numpy" in state:
        n = state["numpy"]
        keys = np.frombuffer(_unb64(n["keys"]), dtype=np.uint32).copy()
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(_unb64(state["torch_cuda"])), dtype=torch.uint8))
