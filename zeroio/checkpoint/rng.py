"""RNG states as JSON (bytes as base64): torch CPU and CUDA, numpy, python `random`.

They are per rank (each rank's dropout stream differs), so they travel in
`ShardedState.rank_scalars`; a resume on another world size gives rank r the
state of rank r % N, which keeps runs reproducible though not identical to
an uninterrupted run on N ranks.
"""

from __future__ import annotations

import base64
import math
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


def check(state: Any) -> None:
    """``ValueError`` naming the first part of ``state`` that ``restore`` could not set this
    process's generators to (a wrong size, type or range), before anything is restored."""
    if not isinstance(state, dict):
        raise ValueError(f"is a {type(state).__name__}, not an object")
    if "torch_cpu" in state:
        _check_bytes(state["torch_cpu"], torch.get_rng_state().numel(), "torch_cpu")
    if "torch_cuda" in state and torch.cuda.is_available():
        _check_bytes(state["torch_cuda"], torch.cuda.get_rng_state().numel(), "torch_cuda")
    if "numpy" in state:
        n = state["numpy"]
        kind, keys, pos, _, _ = np.random.get_state()
        if not isinstance(n, dict) or n.get("kind") != kind:
            raise ValueError(f"numpy is not a {kind} state")
        _check_bytes(n.get("keys"), len(keys) * 4, "numpy.keys")
        _check_int(n.get("pos"), 0, len(keys), "numpy.pos")
        _check_int(n.get("has_gauss"), 0, 1, "numpy.has_gauss")
        _check_number(n.get("cached_gaussian"), "numpy.cached_gaussian")
    if "python" in state:
        p = state["python"]
        version, internal, _ = random.getstate()
        words = p.get("state") if isinstance(p, dict) else None
        if not isinstance(p, dict) or p.get("version") != version or \
                not isinstance(words, list) or len(words) != len(internal):
            raise ValueError(f"python is not a version {version} state of {len(internal)} words")
        for i, w in enumerate(words[:-1]):
            _check_int(w, 0, 2**32 - 1, f"python.state[{i}]")
        _check_int(words[-1], 0, len(internal) - 1, "python.state[-1]")
        if p.get("gauss_next") is not None:
            _check_number(p.get("gauss_next"), "python.gauss_next")


def _check_bytes(text: Any, nbytes: int, what: str) -> None:
    try:
        n = len(base64.b64decode(text.encode("ascii"), validate=True))
    except (AttributeError, ValueError):  # not a str, not ASCII, not base64 (binascii.Error)
        raise ValueError(f"{what} is not base64 text") from None
    if n != nbytes:
        raise ValueError(f"{what} holds {n} bytes, this process's generator {nbytes}")


def _check_int(v: Any, lo: int, hi: int, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{what} is {v!r}, not an integer in [{lo}, {hi}]")


def _check_number(v: Any, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} is {v!r}, not a finite number")


def restore(state: dict[str, Any]) -> None:
    """Set this process's RNG states from `capture()`'s output (missing parts are left alone;
    ``check`` first: what it passes, this sets)."""
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
