"""Swap state on NVMe: private folders and files, and crashed runs' folders cleaned up.

Swap files hold live optimizer state and parameters: 0600 files in 0700
folders, whatever the umask (checked with stat). A run that crashed leaves its
swap folder behind; the next store on the same ``nvme_path`` removes exactly
the folders zeroio wrote (marker) whose writer is provably gone on this host,
and nothing else.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import zeroio
from zeroio.io.store import TensorStore
from zeroio.optim.swap import SwappedAdam
from zeroio.partition.base import Segment, ShardGroup
from zeroio.tiering import MemoryBackend

MARKER, FORMAT = "zeroio-swap.json", "zeroio-swap"  # [Note: swap folders] in zeroio/io/swapdir.py
HYPER = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}]


@pytest.fixture(autouse=True)
def umask_022():
    old = os.umask(0o022)  # the common default: files 0644 and folders 0755 unless set explicitly
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _cfg(nvme_path: Path):
    return zeroio.load_config({
        "train_batch_size": 1,
        "zero_optimization": {"stage": 2, "sub_group_size": 64, "tiering": {"nvme_reserve_bytes": 0},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path),
                                                    "buffer_count": 2}}})


def _groups():
    torch.manual_seed(0)
    return [ShardGroup(group_index=0, master=torch.randn(300), grad=torch.randn(300), numel=300,
                       segments=(Segment(local_offset=0, global_offset=0, numel=300),))]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_swap_folders_are_0700_and_swap_files_0600(tmp_path):
    nvme = tmp_path / "new" / "nvme"  # made by zeroio
    opt = SwappedAdam(_groups(), HYPER, decoupled=True, cfg=_cfg(nvme))
    try:
        opt.step(grad_scale=1.0)
        opt.step(grad_scale=1.0)
        (root,) = (nvme / "zeroio-optim-rank0").glob("zeroio-swap-*")
        dirs = [root, *[p for p in root.rglob("*") if p.is_dir()]]
        files = [p for p in root.rglob("*") if p.is_file()]
        chunks = [p for p in files if p.parent.name == "c"]
        assert len(chunks) >= 2, files  # both moments of the one piece are on disk
        assert {str(p): _mode(p) for p in dirs} == {str(p): 0o700 for p in dirs}
        assert {str(p): _mode(p) for p in files} == {str(p): 0o600 for p in files}
        for made in (nvme, nvme / "zeroio-optim-rank0"):
            assert _mode(made) == 0o700, made
        marker = json.loads((root / MARKER).read_text())
        assert marker["pid"] == os.getpid() and marker["host"] == socket.gethostname()
    finally:
        opt.close()
    assert not root.exists()  # a clean close removes the folder


def test_private_store_creates_unpreallocated_chunk_files_0600(tmp_path):
    with TensorStore(tmp_path / "s", private=True) as store:
        store.create("a/b", 100, torch.float32, chunk_elems=40, preallocate=False)
        store.write("a/b", torch.arange(100.0)).result()
        assert torch.equal(store.read("a/b").result(), torch.arange(100.0))
    files = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
    assert len([p for p in files if p.parent.name == "c"]) == 3
    assert all(_mode(p) == 0o600 for p in files), {str(p): oct(_mode(p)) for p in files}
    assert all(_mode(p) == 0o700 for p in (tmp_path / "s").rglob("*") if p.is_dir())


def _leftover(parent: Path, name: str, marker: dict | str | None) -> Path:
    d = parent / name
    (d / "s000000" / "c").mkdir(parents=True)
    (d / "s000000" / "c" / "0").write_bytes(b"\0" * 64)
    if isinstance(marker, dict):
        (d / MARKER).write_text(json.dumps({"format": FORMAT, **marker}))
    elif isinstance(marker, str):
        (d / MARKER).write_text(marker)
    return d


def test_crashed_runs_swap_folders_are_removed_only_when_provably_ours_and_dead(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    me = {"pid": os.getpid(), "host": host, "start": psutil.Process().create_time()}
    rank3 = tmp_path / "zeroio-optim-rank3"  # a rank the next run does not have
    params = tmp_path / "stage3-params-rank0"
    gone = [_leftover(rank3, f"zeroio-swap-{dead}-0000aaaa", {"pid": dead, "host": host}),
            _leftover(params, f"zeroio-swap-{dead}-0000bbbb", {"pid": dead, "host": host}),
            # the pid now runs, but as a process started later: reused, the writer is gone
            _leftover(rank3, f"zeroio-swap-{os.getpid()}-0000cccc",
                      {"pid": os.getpid(), "host": host, "start": me["start"] - 3600})]
    kept = [_leftover(rank3, "zeroio-swap-1-nomarker", None),
            _leftover(rank3, f"zeroio-swap-{dead}-halfmark", '{"format": "zeroio-swap", "pi'),
            _leftover(rank3, f"zeroio-swap-{dead}-otherhost", {"pid": dead, "host": "elsewhere"}),
            _leftover(rank3, f"zeroio-swap-{os.getpid()}-live", me),
            _leftover(tmp_path / "my-data", "zeroio-swap-notours", None)]
    (tmp_path / "notes.txt").write_text("mine")
    opt = SwappedAdam(_groups(), HYPER, decoupled=True, cfg=_cfg(tmp_path), backend=MemoryBackend())
    opt.close()
    assert [d for d in gone if d.exists()] == []
    assert [d for d in kept if not (d / "s000000" / "c" / "0").is_file()] == []
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_owner_records():
    from zeroio.io import swapdir

    me = swapdir.owner()
    assert swapdir.owner_gone(me) is False
    assert swapdir.owner_gone({**me, "pid": _dead_pid()}) is True
    assert swapdir.owner_gone({**me, "host": "elsewhere", "pid": _dead_pid()}) is None
    assert swapdir.owner_gone({"pid": "12", "host": me["host"]}) is None
