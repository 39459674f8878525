"""crc32c of tensor bytes, and combining the crcs of adjacent pieces: the one crc32c helper.

Every crc zeroio stores goes through here: the per-chunk crc32c of a swap
array (``TensorStore``, the zarr crc32c codec) and the chunk and manifest crcs
of a checkpoint. It is the Castagnoli crc of zarr's ``crc32c`` codec and of
the ``google_crc32c`` package, which computes it.

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


def crc32c(data: torch.Tensor | np.ndarray | bytes, crc: int = 0) -> int:
    """crc32c of a tensor's raw bytes (contiguous, CPU), a uint8 array or bytes; with ``crc``,
    the crc of the bytes that crc covers followed by ``data`` (no copy either way)."""
    if isinstance(data, torch.Tensor):
        data = readonly_bytes(data)
    elif isinstance(data, np.ndarray) and data.flags.writeable:
        data = data.view()
        data.flags.writeable = False  # google_crc32c wants a read-only buffer; this is not a copy
    return google_crc32c.extend(crc, data) if crc else google_crc32c.value(data)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the crc32c polynomial (reflected bit order: x^0 is bit 31)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()  # x^(2^k) mod P, k = 0..31: combine costs popcount(len) products, no squaring


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A || B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B) in bytes.

    crc(A || B) = crc(A) * x^(8 len2) + crc(B) mod P (the pre/post inversions cancel);
    x^(8 len2) is a product of precomputed x^(2^k), one per set bit of 8 len2.
    """
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    shift, k, n = 1 << 31, 3, len2  # x^0; 8 * len2 bits = bit k of len2 shifted by 3
    while n:
        if n & 1:
            shift = _multmodp(_X2N[k & 31], shift)
        n >>= 1
        k += 1
    return _multmodp(shift, crc1) ^ crc2 if len2 else crc1


_ZEROS = np.zeros(1 << 20, dtype=np.uint8)
_ZEROS.flags.writeable = False


def zeros_crc(nbytes: int, crc: int = 0) -> int:
    """crc32c of ``nbytes`` zero bytes (the padding of an array's last chunk), or with ``crc``
    of the bytes that crc covers followed by them."""
    for lo in range(0, nbytes, _ZEROS.nbytes):  # streamed over one shared zero page run
        crc = google_crc32c.extend(crc, _ZEROS[: min(_ZEROS.nbytes, nbytes - lo)])
    return crc
