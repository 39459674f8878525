"""Crashes and full disks during a save: what is on disk afterwards always loads.

Kill: a forked child runs `save_sharded` and SIGKILLs itself just before its k-th change
to the file system (a file opened for writing, a pwrite, an ftruncate, a mkdir, a rename,
an unlink, an rmdir), for many k between 0 and the number of changes a save makes
(counted by a dry run; every change of the directory tree among them). The counting
wraps the `os` functions, so it does not depend on how the save is written. After each kill the parent checks, against tensors rebuilt from seeds:
the tag loads and is entirely the old copy or entirely the new one, the outcome never
goes back from new to old as k grows, `latest` names a complete tag, nothing outside the
checkpoint directory changed, and the next save cleans up and succeeds.

ENOSPC: a write that runs out of space half way (os.pwrite on the buffered path; the io
layer's OsOps on the direct path) fails the save with an error naming the file; the tag,
`latest` and the previous copy are as they were, and nothing is left beside the tag.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

import pytest
import torch

from zeroio.checkpoint import (
    SaveOptions,
    Segment,
    ShardedState,
    build_index,
    load_sharded,
    save_sharded,
    scan_tags,
)
from zeroio.checkpoint import tags as tags_mod
from zeroio.errors import CheckpointError

SHAPES = [("a.w", (7, 5)), ("a.b", (5,)), ("b.w", (5, 5)), ("b.b", (3,))]
INDEX = build_index(SHAPES)
TOTAL = sum(e.numel for e in INDEX.values())  # 68
OPTS = SaveOptions(chunk_bytes=128, progress=False, threads=2)  # 32 fp32 elements a chunk: 3 chunks
KINDS = ("fp32", "exp_avg")


def ref(kind: str, seed: int) -> torch.Tensor:
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 * seed + len(kind)))


def state(seed: int) -> ShardedState:
    cut = 41  # two segments a kind, cut inside a chunk: pieces share chunk files
    return ShardedState(index=dict(INDEX),
                        arrays={k: [Segment(0, ref(k, seed)[:cut].clone()), Segment(cut, ref(k, seed)[cut:].clone())]
                                for k in KINDS},
                        scalars={"seed": seed}, meta={"stage": 1})


def which_seed(root, tag) -> int:
    """The seed of the copy ``tag`` loads as (all kinds and scalars from one save), else fail."""
    bufs = {k: torch.full((TOTAL,), float("nan")) for k in KINDS}
    res = load_sharded(root, tag, ShardedState(index=dict(INDEX), arrays={k: [Segment(0, b)] for k, b in bufs.items()}))
    seed = res.scalars["seed"]
    for k, b in bufs.items():
        assert torch.equal(b, ref(k, seed)), f"{tag}: array {k} is not the seed-{seed} save's"
    return seed


# ---------------------------------------------------------------- counting file-system changes

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


class _Changes:
    """Wraps the `os` functions a save changes the disk with; calls ``at(k)`` before the k-th."""

    NAMES = ("open", "pwrite", "ftruncate", "mkdir", "rename", "replace", "unlink", "rmdir")

    def __init__(self, at):
        self.at, self.n, self.lock, self.real, self.ops = at, 0, threading.Lock(), {}, []

    def _wrap(self, name):
        real = self.real[name]

        def call(*args, **kwargs):
            if name != "open" or (args[1] if len(args) > 1 else kwargs.get("flags", 0)) & _WRITE_FLAGS:
                with self.lock:
                    k, self.n = self.n, self.n + 1
                    self.ops.append(name)
                self.at(k)
            return real(*args, **kwargs)
        return call

    def __enter__(self):
        for name in self.NAMES:
            self.real[name] = getattr(os, name)
            setattr(os, name, self._wrap(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(os, name, fn)


def _kill_points(root, tag, seed, writes: bool) -> tuple[int, list[int]]:
    """(changes a save makes, the ones to kill before): every change of the directory tree
    (mkdir, rename, unlink, rmdir), with ``writes`` every fourth other change (a file opened
    for writing, a pwrite, an ftruncate), plus the end (no kill)."""
    with _Changes(lambda k: None) as c:
        save_sharded(state(seed), root, tag, options=OPTS)
    tree = {"mkdir", "rename", "replace", "unlink", "rmdir"}
    points = [k for k, op in enumerate(c.ops) if op in tree or writes and k % 4 == 0]
    return c.n, points + [c.n]


def _kill_at(k: int):
    def at(i):
        if i == k:
            os.kill(os.getpid(), signal.SIGKILL)
    return at


def _save_in_child(root, tag, seed, k) -> bool:
    """Fork; the child saves and is SIGKILLed before its k-th change. True if it was killed."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            with _Changes(_kill_at(k)):
                save_sharded(state(seed), root, tag, options=OPTS)
        except BaseException:  # noqa: BLE001 - reported through the exit status
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the save failed in the child"
    return False


def _tree(path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _fresh(base, into):
    """A copy of the directory ``base`` (byte for byte, the same layout) at ``into``."""
    import shutil

    shutil.copytree(base, into, symlinks=True)
    return into


@pytest.mark.parametrize("case", ["existing-tag", "existing-tag-two-renames", "new-tag"])
def test_kill_during_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, case):
    """Re-saving a tag (committed by an atomic exchange, or by two renames on a file system
    without one), and saving a new tag (one rename). Kill points: every change of the tree
    (mkdir, rename, unlink, rmdir: the layout, the commit, the cleanup) and every fourth file
    write (the writes are alike), or the tree changes only where the writes are the same as
    in another case."""
    resave = case.startswith("existing")
    if case.endswith("two-renames"):  # a file system without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(tags_mod, "exchange", lambda a, b: False)
    base = tmp_path / "base" / "ckpt"
    save_sharded(state(0), base, "ckpt", options=OPTS)
    (base / "NOTES.txt").write_text("mine")  # files zeroio never wrote, inside and beside
    (base.parent / "beside.txt").write_text("also mine")
    tag = "ckpt" if resave else "next"
    n, points = _kill_points(_fresh(base.parent, tmp_path / "count") / "ckpt", tag, 1,
                             writes=not case.endswith("two-renames"))
    assert n > 20 and len(points) > 10  # many kill points, each checked below
    outcomes = []
    for k in points:
        top = _fresh(base.parent, tmp_path / f"k{k}")
        root = top / "ckpt"
        killed = _save_in_child(root, tag, 1, k)
        assert killed == (k < n)
        assert (root / "NOTES.txt").read_text() == "mine" and (top / "beside.txt").read_text() == "also mine"
        seed = which_seed(root, "ckpt")
        assert seed in ((0, 1) if resave else (0,))  # never missing, never mixed
        latest = (root / "latest").read_text().strip()
        assert latest in {s.tag for s in scan_tags(root) if s.complete}, f"k={k}: latest names {latest!r}"
        if resave:
            outcomes.append(seed)
        else:
            outcome = which_seed(root, None)  # what a resume takes
            assert outcome == (1 if latest == "next" else 0)
            if (root / "next").exists():
                assert which_seed(root, "next") == 1
            outcomes.append(outcome)
        # the next save finishes or removes what the crash left, and succeeds
        save_sharded(state(2), root, tag, options=OPTS)
        assert which_seed(root, None) == 2
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
        assert (root / "NOTES.txt").read_text() == "mine"
    assert outcomes == sorted(outcomes) and outcomes[0] == 0 and outcomes[-1] == 1  # old, then new, never back


# ---------------------------------------------------------------- ENOSPC inside a write


def _full_after(budget: int, real):
    """os.pwrite that writes ``budget`` bytes in all, short where it runs out, then ENOSPC."""
    left = [budget]
    lock = threading.Lock()

    def pwrite(fd, data, offset):
        with lock:
            n = min(len(data), left[0])
            left[0] -= n
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, memoryview(data)[:n], offset)
    return pwrite


def _check_untouched(root, before):
    assert _tree(root) == before  # tag, latest, every byte as it was; nothing left beside
    assert which_seed(root, "ckpt") == 0 and which_seed(root, None) == 0
    save_sharded(state(2), root, "ckpt", options=OPTS)  # space again: the save goes through
    assert which_seed(root, "ckpt") == 2


@pytest.mark.parametrize("tag", ["ckpt", "other"], ids=["existing-tag", "new-tag"])
def test_enospc_inside_a_write_fails_the_save_and_keeps_the_previous_one(tmp_path, monkeypatch, tag):
    root = tmp_path / "ckpt"
    save_sharded(state(0), root, "ckpt", options=OPTS)
    before = _tree(root)
    monkeypatch.setattr(os, "pwrite", _full_after(300, os.pwrite))  # mid-way through the second kind
    with pytest.raises(OSError, match=r"No space left on device") as e:
        save_sharded(state(1), root, tag, options=OPTS)
    assert e.value.errno == errno.ENOSPC and "/c/" in str(e.value)  # names the chunk file
    assert "nothing was committed" in str(e.value).lower()
    monkeypatch.undo()
    _check_untouched(root, before)


def test_enospc_in_the_io_engine_on_the_direct_path(tmp_path, monkeypatch):
    from zeroio.checkpoint import writer
    from zeroio.io.engine import IOEngine
    from zeroio.io.osops import OsOps

    class FullDisk(OsOps):
        def pwritev(self, fd, buffers, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    root = tmp_path / "ckpt"
    save_sharded(state(0), root, "ckpt", options=OPTS)
    before = _tree(root)
    monkeypatch.setattr(writer, "open_engine", lambda pool: IOEngine(thread_count=pool.threads, os_ops=FullDisk()))
    with pytest.raises(OSError, match=r"no space left for .*/c/") as e:
        save_sharded(state(1), root, "ckpt", options=SaveOptions(chunk_bytes=128, progress=False, direct=True))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    _check_untouched(root, before)


def test_a_folder_zeroio_did_not_write_is_never_replaced_or_removed(tmp_path):
    root = tmp_path / "ckpt"
    save_sharded(state(0), root, "ckpt", options=OPTS)
    (root / "mine").mkdir()
    (root / "mine" / "weights.bin").write_bytes(b"\x01" * 10)
    (root / "afile").write_text("x")
    for tag in ("mine", "afile"):
        with pytest.raises(CheckpointError, match=rf"{tag} exists and is not a zeroio checkpoint"):
            save_sharded(state(1), root, tag, options=OPTS)
    assert (root / "mine" / "weights.bin").read_bytes() == b"\x01" * 10 and (root / "afile").read_text() == "x"
    # a file the user put inside a tag survives a re-save: the old copy keeps it, with a warning
    (root / "ckpt" / "notes.txt").write_text("keep me")
    with pytest.warns(UserWarning, match=r"zeroio did not write .*notes\.txt"):
        save_sharded(state(1), root, "ckpt", options=OPTS)
    assert which_seed(root, "ckpt") == 1
    (kept,) = root.glob(".zeroio-*.ckpt/notes.txt")
    assert kept.read_text() == "keep me"
    with pytest.raises(CheckpointError, match=r"still holds files zeroio did not write"):
        save_sharded(state(2), root, "ckpt", options=OPTS)
    assert kept.read_text() == "keep me" and which_seed(root, "ckpt") == 1
