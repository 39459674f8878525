"""The run directory of `zeroio train` (--output DIR): one job at a time, and nothing lost.

[Note: run directory]
- Lock. ``DIR/zeroio.lock`` is held for the whole job by the process that
  starts it: the one that launches the ranks, or rank 0 under an outside
  launcher. It is an exclusive ``flock`` on that file (atomic, and released by
  the kernel however the holder ends), and the file names the holder: pid,
  host, start time and a token. A second run on DIR finds the flock taken and
  is refused, naming that pid and host. A lock file whose flock is free but
  whose holder is provably gone (its pid dead on this host) is taken over with
  a note; one that names another host, or a live process, is refused (delete
  the file once that run is known to be gone). Ranks launched by the holder
  find its token in ``ZEROIO_RUN_LOCK`` (set by the holder, not a user
  setting) and do not take the lock again. On exit the lock file is removed,
  and DIR too when the lock made it and nothing else was written.
- What zeroio wrote. ``DIR/zeroio-run.json`` lists every file zeroio wrote
  under DIR/checkpoints and DIR/model (path, size, mtime), updated by rank 0
  after each checkpoint and after the model export. Before each of those
  writes it claims the folder (or file) it is about to write: everything
  under a claim counts as zeroio's, so what a crash or kill left half-written
  is still removed by the next fresh run; the finished write replaces the
  claim by the exact list. Swap folders under
  DIR/nvme carry their own marker ([Note: swap folders] in zeroio/io/swapdir.py).
- Fresh run (no --resume). A file in DIR/model, DIR/checkpoints or DIR/nvme
  that zeroio did not write (not listed, or changed since; outside a marked
  swap folder) makes the run refuse before launching: move it away, pass
  ``--overwrite`` (those three folders are then emptied whole) or pick another
  --output. Otherwise the listed files are deleted (a stale checkpoint with a
  higher step than the new run reaches would be the one a later --resume
  picks) and the folders left empty by that. --resume keeps checkpoints/ and
  nvme/; the final export replaces model/, so the same rule applies to model/.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from zeroio import jsonlimits
from zeroio.config.launch_env import RUN_LOCK, export, launch_env
from zeroio.errors import ConfigError
from zeroio.io.files import atomic_write_text, open_lock_file, read_fd, rewrite_fd

LOCK = "zeroio.lock"
WRITTEN = "zeroio-run.json"
ENV = RUN_LOCK
PARTS = ("model", "checkpoints", "nvme")
_FORMAT = "zeroio-run"
_SHOW = 5  # foreign files named in a refusal


class RunLock:
    """The held lock of one run directory ([Note: run directory])."""

    def __init__(self, out: Path, fd: int, token: str, made: list[Path]):
        self.out, self.fd, self.token, self._made = out, fd, token, made

    @property
    def path(self) -> Path:
        return self.out / LOCK

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while the flock is held: no one can be between open and check
        os.close(self.fd)
        self.fd = -1
        for d in reversed(self._made):  # folders the lock made, if nothing else was put there
            with contextlib.suppress(OSError):
                d.rmdir()


def _holder(fd: int) -> dict:
    try:
        rec = jsonlimits.loads(read_fd(fd).decode("utf-8"), "the run lock")
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def _who(rec: dict) -> str:
    if not rec.get("pid"):
        return "another process (its lock file is being written or is unreadable)"
    return f"pid {rec['pid']} on host {rec.get('host', '?')}"


def _make_dirs(out: Path) -> list[Path]:
    made, d = [], out.absolute()
    while not d.exists():
        made.append(d)
        d = d.parent
    out.mkdir(parents=True, exist_ok=True)
    return list(reversed(made))


def acquire(out: Path, *, say=None) -> RunLock:
    """Take DIR's lock or raise ConfigError naming the holder ([Note: run directory])."""
    from zeroio.io.swapdir import owner, owner_gone

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        made = _make_dirs(out)
    except OSError as e:
        raise ConfigError(f"--output {out}: cannot create it as a folder ({e.strerror or e})",
                          key="output") from None
    path = out / LOCK
    while True:
        fd = open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            rec = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"--output {out} is in use by another zeroio train run: {_who(rec)} holds "
                f"{path}. Wait for it to finish (or stop it), or pass another --output",
                key="output") from None
        except OSError as e:  # a file system without flock: the holder record alone decides
            say(f"zeroio train: {path}: no file locks on this file system ({e.strerror}); "
                "relying on the pid and host in the lock file")
            break
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and our flock: again
    rec = _holder(fd)
    if rec.get("pid") and rec.get("pid") != os.getpid():
        gone = owner_gone(rec)
        if gone is not True:
            os.close(fd)
            where = "on another host: zeroio cannot tell whether it still runs" if gone is None \
                else "and that process is running"
            raise ConfigError(
                f"--output {out}: {path} names {_who(rec)}, {where}. If that run is gone, delete "
                f"{path}; or pass another --output", key="output")
        say(f"zeroio train: taking over the lock of {out}: its holder ({_who(rec)}) is gone")
    token = uuid.uuid4().hex
    rewrite_fd(fd, json.dumps({**owner(), "token": token}).encode())
    return RunLock(out, fd, token, made)


def launched_by_holder(out: Path) -> bool:
    """Whether this process was launched by the holder of DIR's lock (its token in the env)."""
    env = launch_env().run_lock
    if not env:
        return False
    try:
        want = json.loads(env)
        rec = jsonlimits.loads((out / LOCK).read_text(encoding="utf-8"), str(out / LOCK))
    except (OSError, ValueError):
        return False
    return (isinstance(want, dict) and isinstance(rec, dict)
            and want.get("path") == str((out / LOCK).absolute()) and rec.get("token")
            and want.get("token") == rec.get("token"))


@contextlib.contextmanager
def claim(out: Path, *, resume: bool, overwrite: bool) -> Iterator[RunLock | None]:
    """Hold DIR's lock for the job and refuse a fresh run over files zeroio did not write.

    Nothing happens in a rank launched by the holder, nor in ranks other than 0 under an
    outside launcher (rank 0 holds it for the job)."""
    if launched_by_holder(out) or (launch_env().rank or 0) != 0:
        yield None
        return
    lock = acquire(out)
    try:
        with export(ENV, json.dumps({"path": str(lock.path.absolute()), "token": lock.token})):
            if not overwrite:
                refuse_foreign(out, PARTS if not resume else ("model",))
            yield lock
    finally:
        lock.release()


# -- what zeroio wrote ------------------------------------------------------------------


def _read_written(out: Path) -> dict[str, list[int]]:
    try:
        doc = jsonlimits.loads((out / WRITTEN).read_text(encoding="utf-8"), str(out / WRITTEN))
    except (OSError, ValueError):
        return {}
    files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == _FORMAT else None
    return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 2} \
        if isinstance(files, dict) else {}


def _write_written(out: Path, files: dict[str, list[int]]) -> None:
    atomic_write_text(out / WRITTEN, json.dumps({"format": _FORMAT, "version": 1,
                                                 "files": dict(sorted(files.items()))}))


def _sig(p: Path) -> list[int]:
    st = p.lstat()
    return [st.st_size, st.st_mtime_ns]


def _files(p: Path) -> Iterable[Path]:
    if p.is_symlink() or p.is_file():
        yield p
    elif p.is_dir():
        for q in sorted(p.rglob("*")):
            if q.is_symlink() or q.is_file():
                yield q


_CLAIM = [-1, -1]


def record(out: Path, paths: Iterable[Path], *, claim: bool = False) -> None:
    """List every file now under ``paths`` (files or folders inside DIR) as written by zeroio,
    replacing what was listed under them before; ``claim``: before writing there, claim
    everything under ``paths`` as zeroio's until the write is recorded."""
    files = _read_written(out)
    for p in paths:
        rel = p.relative_to(out).as_posix()
        if claim:
            files[rel] = _CLAIM
            continue
        files = {k: v for k, v in files.items() if k != rel and not k.startswith(rel + "/")}
        for f in _files(p):
            files[f.relative_to(out).as_posix()] = _sig(f)
    _write_written(out, files)


def _ours(out: Path, f: Path, files: dict[str, list[int]]) -> bool:
    rel = f.relative_to(out)
    if any(files.get(p.as_posix()) == _CLAIM for p in (rel, *rel.parents)):
        return True
    sig = files.get(rel.as_posix())
    return sig is not None and not f.is_symlink() and _sig(f) == sig


def foreign(out: Path, parts: Iterable[str] = PARTS) -> list[Path]:
    """Files in DIR/<part> that zeroio did not write ([Note: run directory])."""
    from zeroio.io.swapdir import is_swap_dir

    files = _read_written(out)
    found = []
    for part in parts:
        top = out / part
        if part == "nvme":
            for root, dirs, names in os.walk(top):
                dirs[:] = [d for d in dirs if not is_swap_dir(Path(root, d))]
                found += [Path(root, n) for n in names]
        else:
            found += [f for f in _files(top) if not _ours(out, f, files)]
    return sorted(found)


def refuse_foreign(out: Path, parts: Iterable[str]) -> None:
    parts = tuple(parts)
    found = foreign(out, parts)
    if not found:
        return
    listed = _read_written(out)

    def name(f: Path) -> str:
        changed = f.is_relative_to(out) and f.relative_to(out).as_posix() in listed
        return f"{f} (changed since zeroio wrote it)" if changed else str(f)

    shown = ", ".join(name(f) for f in found[:_SHOW]) + (f" and {len(found) - _SHOW} more"
                                                         if len(found) > _SHOW else "")
    what = "a fresh run empties" if "checkpoints" in parts else "the final export replaces"
    raise ConfigError(
        f"--output {out}: {len(found)} file(s) that zeroio did not write are in "
        f"{' / '.join(p + '/' for p in parts)}, which {what}: {shown}. Nothing was deleted. Move "
        "them away, or pass --overwrite to delete them, or pass another --output", key="output")


def removable_bytes(out: Path, parts: Iterable[str], *, overwrite: bool) -> int:
    """Bytes ``remove_written`` (or --overwrite) will free under DIR/<part>."""
    files = _read_written(out)
    return sum(f.lstat().st_size for part in parts for f in _files(out / part)
               if overwrite or _ours(out, f, files))


def remove_written(out: Path, parts: Iterable[str], *, overwrite: bool) -> None:
    """Delete what zeroio wrote under DIR/<part> and the folders that leaves empty; with
    ``overwrite`` the folders whole (the user asked for it)."""
    files = _read_written(out)
    kept = dict(files)
    for part in parts:
        top = out / part
        if overwrite:
            shutil.rmtree(top, ignore_errors=True)
            kept = {k: v for k, v in kept.items() if not k.startswith(part + "/")}
            continue
        dirs: set[Path] = set()
        for f in list(_files(top)):
            if _ours(out, f, files):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                kept.pop(f.relative_to(out).as_posix(), None)
                dirs.update(d for d in f.parents if d != top and top in d.parents)
        kept = {k: v for k, v in kept.items()  # claims here: everything under them is gone
                if not (v == _CLAIM and (k == part or k.startswith(part + "/")))}
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty
    if kept != files:
        _write_written(out, kept)
