"""Swap folders under an ``nvme_path``: private, marked with their owner, removed after a crash.

[Note: swap folders] Each NVMe store keeps its files in a fresh folder
``<parent>/zeroio-swap-<pid>-<id>/``, created 0700 with its files 0600 (the
store is built with ``TensorStore(private=True)``): live optimizer state and
parameters are nobody else's to read. Right after creating it, zeroio writes
``zeroio-swap.json`` into it (temp file, rename: it is whole or absent), naming
the owner: pid, host, the process's start time and the boot id.

A process that ends normally removes its folder. One that crashed leaves it;
the next store built on the same ``nvme_path`` (any rank, any run) removes it,
but only when zeroio can prove it wrote it and its writer is gone: the marker
is present and parses, names this host, and the process it names is not
running (no such pid, the pid now belongs to a process started at another
time, or the marker is from an earlier boot). Folders without a marker,
markers that do not parse, other hosts' folders and live processes' folders
are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import uuid
from pathlib import Path

import psutil

from zeroio import jsonlimits
from zeroio.errors import SwapIOError
from zeroio.io.files import atomic_write_text

PREFIX = "zeroio-swap-"
MARKER = "zeroio-swap.json"
FORMAT = "zeroio-swap"
DIR_MODE = 0o700
FILE_MODE = 0o600


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def owner() -> dict:
    """This process as an owner record: pid, host, start time (s since the epoch), boot id."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "start": psutil.Process().create_time(), "boot": _boot_id()}


def owner_gone(rec: dict) -> bool | None:
    """True when the process ``rec`` names provably no longer runs on this host; False when
    it runs; None when that cannot be told (another host, a malformed record)."""
    pid, host = rec.get("pid"), rec.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1 or not isinstance(host, str):
        return None
    if host != socket.gethostname():
        return None
    boot = _boot_id()
    if rec.get("boot") and boot and rec["boot"] != boot:
        return True  # written before this machine last booted
    try:
        start = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return False
    recorded = rec.get("start")
    if isinstance(recorded, (int, float)) and abs(start - recorded) > 1.0:
        return True  # the pid was reused by a later process
    return False


def write_marker(directory: str | os.PathLike, rec: dict, name: str = MARKER) -> None:
    """``rec`` as ``directory/name``, 0600, atomically (temp file in the folder, rename)."""
    atomic_write_text(Path(directory, name), json.dumps(rec), mode=FILE_MODE, durable=False)


def read_marker(directory: str | os.PathLike, name: str = MARKER) -> dict | None:
    """The owner record in ``directory/name``, or None when absent or not one of ours."""
    try:
        rec = jsonlimits.loads(Path(directory, name).read_text(encoding="utf-8"),
                               f"swap folder marker {directory}/{name}")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def make_private_dirs(path: str | os.PathLike) -> list[str]:
    """``os.makedirs(path)`` with every folder it creates 0700 (existing ones untouched); the
    folders it made, outermost first (an owner that fails to initialize removes them again,
    ``remove_if_empty`` in reverse order, so nvme_path is left as it was)."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    made = []
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another rank
        os.chmod(d, DIR_MODE)  # explicit: the umask may only remove bits, never widen
        made.append(d)
    return made


def own_folder(path: str | os.PathLike) -> str | None:
    """``make_private_dirs(path)``; ``path`` when this call made it (its owner removes it at
    close when nothing is left in it: ``remove_if_empty``), None when it was there. Parents it
    had to make stay (the engine removes those of a failed initialize)."""
    made = make_private_dirs(path)
    leaf = os.path.abspath(os.fspath(path))
    return leaf if made and made[-1] == leaf else None


def create(parent: str | os.PathLike) -> str:
    """A fresh, marked, 0700 swap folder under ``parent`` (made if missing); its path.

    Swap folders of crashed runs under ``parent`` are removed first (``remove_stale``).
    """
    root = os.path.join(os.path.abspath(os.fspath(parent)), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        make_private_dirs(parent)
        remove_stale(parent)
        os.mkdir(root, DIR_MODE)
        os.chmod(root, DIR_MODE)
        write_marker(root, {"format": FORMAT, **owner()})
    except OSError as e:
        raise SwapIOError(e.errno or errno.EIO, f"cannot create the swap folder {root}: "
                          f"{e.strerror or e}; check that nvme_path is a writable directory") from e
    return root


def is_swap_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a swap folder zeroio wrote (name and a parsable marker)."""
    rec = read_marker(path) if os.path.basename(os.fspath(path)).startswith(PREFIX) else None
    return rec is not None and rec.get("format") == FORMAT


def find_stale(nvme_path: str | os.PathLike, depth: int = 2) -> list[Path]:
    """Swap folders under ``nvme_path`` (at most ``depth`` levels down) that zeroio wrote and
    whose writer is gone ([Note: swap folders])."""
    found: list[Path] = []
    level = [Path(nvme_path)]
    for _ in range(depth):
        below = []
        for d in level:
            try:
                children = [c for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
            except OSError:
                continue
            for c in children:
                if c.name.startswith(PREFIX):
                    if is_swap_dir(c) and owner_gone(read_marker(c)) is True:
                        found.append(c)
                else:
                    below.append(c)
        level = below
    return sorted(found)


def remove_stale(nvme_path: str | os.PathLike, depth: int = 2) -> list[Path]:
    """Remove ``find_stale(nvme_path)``; the folders removed."""
    gone = find_stale(nvme_path, depth)
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def remove_if_empty(path: str | os.PathLike) -> None:
    """Remove the folder ``path`` when nothing is left in it (a per-rank folder zeroio named
    and made, whose swap folders are gone); a folder with anything in it stays."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


def remove(root: str | os.PathLike) -> None:
    """Remove this process's own swap folder ``root`` (at close)."""
    shutil.rmtree(root, ignore_errors=True)
