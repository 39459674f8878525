"""Option checks shared by `zeroio bench io` and `zeroio tune io`: each bad value is a
ConfigError (exit 2) naming its flag, raised before a byte is written.

Sizes are multiples of 4096 bytes: the engine and the raw tools (dd, fio) transfer with
O_DIRECT, which takes whole 4 KiB blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

from zeroio.errors import ConfigError

ALIGN = 4096


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def size(flag: str, text: str) -> int:
    """``text`` ('4G', '512M', '1048576') as bytes: a positive multiple of 4096."""
    from zeroio.errors import SwapIOError
    from zeroio.io.bench import parse_size

    try:
        n = parse_size(text)
    except SwapIOError:
        raise ConfigError(f"{flag} {text!r}: not a size; write e.g. 4G, 512M, 100MB or a byte "
                          "count", key=_key(flag)) from None
    if n < ALIGN or n % ALIGN:
        raise ConfigError(f"{flag} {text!r} is {n:,} bytes; it must be a positive multiple of "
                          f"{ALIGN} bytes (direct I/O moves whole 4 KiB blocks), e.g. 1M",
                          key=_key(flag))
    return n


def positive(flag: str, value: int | None) -> int | None:
    """``value`` unless it is below 1 (None: the default)."""
    if value is not None and value < 1:
        raise ConfigError(f"{flag} must be >= 1, got {value}", key=_key(flag))
    return value


def size_list(flag: str, text: str) -> list[int]:
    """A comma list of sizes (at least one)."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise ConfigError(f"{flag} {text!r}: give a comma list of sizes, e.g. 256K,1M,4M",
                          key=_key(flag))
    return [size(flag, x) for x in items]


def int_list(flag: str, text: str) -> list[int]:
    """A comma list of integers >= 1 (at least one)."""
    items = [x.strip() for x in text.split(",")]
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a comma list of integers >= 1, e.g. 4,8,32",
                          key=_key(flag)) from None
    for v in values:
        positive(flag, v)
    return values


def directory(flag: str, path: str) -> str:
    """``path`` when it is an existing folder (the test files go there)."""
    if not os.path.isdir(path):
        why = "does not exist" if not os.path.lexists(path) else "is not a folder"
        raise ConfigError(f"{flag} {path} {why}; pass an existing folder on the device to test "
                          "(e.g. the nvme_path)", key=_key(flag))
    return path


def executable(flag: str, path: str | None) -> str | None:
    """``path`` when it names a program this process may run (None: not given)."""
    if path is not None and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError(f"{flag} {path} is not an executable file; pass the path of the fio "
                          "binary, or drop the flag to use fio on PATH", key=_key(flag))
    return path


def aio_block(flag: str, path: str | None) -> dict | None:
    """The ``aio`` block of the DeepSpeed config at ``path``, checked as the config layer
    checks it (None: no file, or no block)."""
    from zeroio.config.fields import build
    from zeroio.config.loader import read_config
    from zeroio.config.sections import AioConfig, check_aio

    if path is None:
        return None
    try:
        raw = read_config(path).get("aio")
        if raw is not None:
            check_aio(build(AioConfig, raw, "aio"))
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}", key=_key(flag)) from None
    return raw


def writable_config(flag: str, path: str | None) -> None:
    """``path`` can take the aio block: absent (created) in an existing folder, or a UTF-8
    JSON object (updated). Checked before the sweep, not after it."""
    from zeroio.config.loader import read_config

    if path is None:
        return
    p = Path(path)
    if not p.parent.absolute().is_dir():
        raise ConfigError(f"{flag} {path}: its folder {p.parent} does not exist",
                          key=_key(flag))
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; pass a JSON file", key=_key(flag))
    if os.path.lexists(p):
        try:
            read_config(p)
        except ConfigError as e:
            raise ConfigError(f"{flag} {path} cannot take the aio block: {e}. Fix the file, or "
                              "pass a new file name", key=_key(flag)) from None
