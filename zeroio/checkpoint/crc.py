"""crc32c of tensor bytes, and combining the crcs of adjacent pieces.

[Note: piece crcs] A chunk of a checkpoint array is usually written by more
than one rank (rank boundaries fall anywhere in the global flat order). Each
rank computes the crc32c of the bytes *it* wrote, from memory; rank 0 then
combines the pieces of each chunk into the chunk's crc with `combine`
(crc32c is linear over GF(2), so crc(A || B) follows from crc(A), crc(B) and
len(B), as zlib's crc32_combine does for crc32). No rank has to read another
rank's bytes back, and a chunk whose pieces do not tile it exactly is caught
as a gap before the manifest is written.
"""

from __future__ import annotations

import google_crc32c
import numpy as np
import torch

_POLY = 0x82F63B78  # crc32c (Castagnoli), reflected


def readonly_bytes(t: torch.Tensor) -> np.ndarray:
    """A read-only uint8 numpy view of a contiguous CPU tensor (google_crc32c needs read-only)."""
    arr = t.reshape(-1).view(torch.uint8).numpy().view()
    arr.flags.writeable = False
    return arr


def crc32c(data: torch.Tensor | np.ndarray | bytes) -> int:
    """crc32c of a tensor's raw bytes (contiguous, CPU), a uint8 array or bytes."""
    if isinstance(data, torch.Tensor):
        data = readonly_bytes(data)
    elif isinstance(data, np.ndarray) and data.flags.writeable:
        data = data.view()
        data.flags.writeable = False
    return google_crc32c.value(data)


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A || B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B) in bytes."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    if len2 == 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # operator: shift one zero bit in
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    while True:
        even = _square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = _times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _square(even)
        if len2 & 1:
            crc1 = _times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def zeros_crc(nbytes: int) -> int:
    """crc32c of ``nbytes`` zero bytes (the padding of an array's last chunk)."""
    return crc32c(np.zeros(nbytes, dtype=np.uint8))
