"""Checkpoints that share the NVMe swap files of the optimizer's moments instead of copying them.

References: the raw bytes of the files (sha256 at save time, inodes and link counts from
os.stat), the optimizer's moments in memory at save time, an uninterrupted run (losses and
parameters, bit for bit) and the same state saved through the copy path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroio.testing import run_ranks

BATCH = 4


def _model():
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _config(world: int, stage: int, nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "sub_group_size": 100,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                              # a host share smaller than the moments: pieces stream to disk
                              "tiering": {"cpu_budget_bytes": 30000}},
    }


def _engine(world, stage, nvme, seed=0):
    import zeroio

    torch.manual_seed(seed)
    engine, *_ = zeroio.initialize(model=_model(), config=_config(world, stage, nvme))
    engine.show_progress = False
    return engine


def _train(engine, steps):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def _no_reflink():
    """Make the test's file system look like ext4 (no FICLONE) wherever it runs."""
    from zeroio.io import links

    def refuse(src_fd, dst):
        raise OSError(errno.EOPNOTSUPP, "reflink disabled by the test")

    links._reflink = refuse


def _hashes(tag_dir: str) -> dict[str, str]:
    out = {}
    for d, _dirs, files in os.walk(tag_dir):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, tag_dir)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _extent_files(tag_dir: str) -> list[str]:
    return sorted(os.path.join(tag_dir, k, "x", f) for k in ("exp_avg", "exp_avg_sq")
                  for f in os.listdir(os.path.join(tag_dir, k, "x")))


def _swap_inodes(nvme: str) -> set[int]:
    return {os.stat(os.path.join(d, f)).st_ino for d, _ds, fs in os.walk(nvme) for f in fs}


def _global_moments(engine) -> dict[str, np.ndarray]:
    """This rank's moments put in global order (zeros elsewhere), from the optimizer's memory."""
    total = engine.partitioner.index.total_numel
    out = {}
    for kind in ("exp_avg", "exp_avg_sq"):
        flat = torch.zeros(total, dtype=torch.float32)
        for g in engine.partitioner.groups:
            local = engine.optimizer.local_tensor(g.group_index, kind)
            for s in g.segments:
                flat[s.global_offset:s.global_offset + s.numel] = local[s.local_offset:s.local_offset + s.numel]
        out[kind] = flat.numpy()
    return out


def _read_array(tag_dir: str, kind: str) -> np.ndarray:
    from zeroio.checkpoint.layout import read_manifest
    from zeroio.checkpoint.reader import ArrayReader

    return ArrayReader(read_manifest(os.path.join(tag_dir, "manifest.json"))).read(kind).numpy()


def _links_phase(root):
    """Save (shared), check links, train on, save again: the first tag's bytes must not move."""
    _no_reflink()
    nvme = os.path.join(root, "nvme")
    e = _engine(1, 2, nvme)
    _train(e, range(3))
    moments = _global_moments(e)
    tag = str(e.save_checkpoint(os.path.join(root, "ck"), tag="a"))
    report = dict(e.last_save)
    files = _extent_files(tag)
    swap = _swap_inodes(nvme)
    linked = [(os.stat(f).st_nlink, os.stat(f).st_ino in swap) for f in files]
    before = _hashes(tag)
    stored = {k: _read_array(tag, k) for k in moments}
    _train(e, range(3, 6))  # every streamed piece is written back: each write breaks its link
    e.save_checkpoint(os.path.join(root, "ck"), tag="b")
    after = _hashes(tag)
    nlink_after = [os.stat(f).st_nlink for f in files]
    e.close()
    return {"report": report, "linked": linked, "same": before == after, "n_files": len(before),
            "nlink_after": nlink_after, "equal": {k: bool(np.array_equal(stored[k], moments[k])) for k in moments},
            "nonzero": {k: bool(np.abs(moments[k]).sum() > 0) for k in moments}}


def test_shared_save_hard_links_swap_files_and_keeps_its_bytes(tmp_path):
    (r,) = run_ranks(_links_phase, 1, str(tmp_path), timeout=300)
    rep = r["report"]
    assert rep["mode"] == "shared" and rep["files_hardlinked"] == len(r["linked"]) > 0, rep
    assert rep["files_copied"] == 0 and rep["fallback"] is None, rep
    # every extent is a second name of a swap file: same inode, two links
    assert all(n == 2 and in_swap for n, in_swap in r["linked"]), r["linked"]
    # written: the fp32 chunk and the dirty pieces flushed; never the moments a second time
    assert rep["bytes_written"] < rep["full_copy_bytes"], rep
    assert r["equal"] == {"exp_avg": True, "exp_avg_sq": True} and all(r["nonzero"].values())
    assert r["same"] and r["n_files"] > len(r["linked"])
    # training rewrote every piece: its swap file is a new inode, the checkpoint keeps the old one
    assert r["nlink_after"] == [1] * len(r["linked"]), r["nlink_after"]


def _resume_phase_a(root):
    import torch.distributed as dist

    from zeroio.checkpoint import tags
    from zeroio.checkpoint.engine_io import save_checkpoint
    from zeroio.checkpoint.writer import SaveOptions

    _no_reflink()
    rank = dist.get_rank()
    e = _engine(2, 3, os.path.join(root, f"nvme-s{rank}"))
    straight = _train(e, range(8))
    final = {n: p.detach().clone().numpy() for n, p in e.module.named_parameters()}
    e.close()
    nvme = os.path.join(root, f"nvme-a{rank}")
    e = _engine(2, 3, nvme)
    first = _train(e, range(4))
    e.save_checkpoint(os.path.join(root, "ck"), tag="t")
    shared = dict(e.last_save)
    e.save_checkpoint(os.path.join(root, "ck"), tag="t")  # re-save: the old copy's names are removed
    save_checkpoint(e, os.path.join(root, "copy"), tag="t",
                    options=SaveOptions(share_swap=False, progress=False))
    # an old checkpoint removed by hand: the swap files it shared stay the optimizer's
    e.save_checkpoint(os.path.join(root, "old"), tag="o")
    dist.barrier()
    if rank == 0:
        assert tags.remove_owned(Path(root) / "old" / "o") == []
    dist.barrier()
    cont = _train(e, range(4, 8))
    cont_params = {n: p.detach().clone().numpy() for n, p in e.module.named_parameters()}
    # a later save writes every piece the steps dirtied, resident ones too: never into "t"'s files
    e.save_checkpoint(os.path.join(root, "later"), tag="l")
    e.close()
    return {"straight": straight, "first": first, "final": final, "shared": shared, "cont": cont,
            "cont_params": cont_params,
            "swap_left": [f for _d, _ds, fs in os.walk(nvme) for f in fs]}


def _resume_phase_b(root):
    import torch.distributed as dist

    rank = dist.get_rank()
    e = _engine(2, 3, os.path.join(root, f"nvme-b{rank}"), seed=5)
    e.load_checkpoint(os.path.join(root, "ck"), tag="t")
    rest = _train(e, range(4, 8))
    params = {n: p.detach().clone().numpy() for n, p in e.module.named_parameters()}
    e.close()
    return {"rest": rest, "params": params}


def test_resume_from_shared_checkpoint_on_two_ranks_is_exact_and_equals_the_copy_path(tmp_path):
    from zeroio.checkpoint import consolidate
    from zeroio.cli.inspect_cmd import describe

    root = str(tmp_path)
    a = run_ranks(_resume_phase_a, 2, root, timeout=300)
    assert a[0]["swap_left"] == a[1]["swap_left"] == []  # close removed the swap files
    for rank in range(2):  # nothing of the runs' swap folders is left; the checkpoint must not need them
        shutil.rmtree(os.path.join(root, f"nvme-a{rank}"), ignore_errors=True)
    b = run_ranks(_resume_phase_b, 2, root, timeout=300)
    a0, b0 = a[0], b[0]
    assert all(r["shared"]["mode"] == "shared" and r["shared"]["files_hardlinked"] > 0 for r in a)
    assert a0["cont"] == a0["straight"][4:]  # re-saving and removing checkpoints left the run alone
    assert a0["first"] + b0["rest"] == a0["straight"]  # bit for bit
    for n, ref in a0["final"].items():
        assert np.array_equal(b0["params"][n], ref), n
        assert np.array_equal(a0["cont_params"][n], ref), n
    ck, copy = os.path.join(root, "ck", "t"), os.path.join(root, "copy", "t")
    with open(os.path.join(ck, "manifest.json")) as fh:
        doc = json.load(fh)
    assert doc["format_version"] == 3 and doc["arrays"]["exp_avg"]["layout"] == "extents"
    assert doc["meta"]["save"]["files_hardlinked"] > 0
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):  # the shared layout holds the copy path's values
        assert np.array_equal(_read_array(ck, kind), _read_array(copy, kind)), kind
    full, via_copy = consolidate(os.path.join(root, "ck"), "t"), consolidate(os.path.join(root, "copy"), "t")
    assert all(torch.equal(full[n], via_copy[n]) for n in via_copy) and set(full) == set(via_copy)
    info = describe(os.path.join(root, "ck"), "t", verify=True)
    assert info["tags"][0]["verified"] and info["tags"][0]["arrays"]["exp_avg"]["layout"] == "extents"
    # a damaged extent is found by inspect --verify, naming its file
    victim = _extent_files(ck)[0]
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as fh:
        fh.seek(3)
        byte = fh.read(1)
        fh.seek(3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    bad = describe(os.path.join(root, "ck"), "t", verify=True)["tags"][0]
    assert not bad["verified"] and os.path.basename(victim) in bad["problem"], bad


def _cross_fs_phase(root, how):
    from zeroio.io import links

    def exdev(*a, **k):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    links._reflink = exdev
    links._hardlink = exdev
    if how == "device":  # the checkpoint directory on another file system, seen up front
        import zeroio.checkpoint.engine_io as eio

        eio.same_device = lambda a, b: False
    e = _engine(1, 2, os.path.join(root, "nvme"))
    _train(e, range(3))
    moments = _global_moments(e)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tag = str(e.save_checkpoint(os.path.join(root, "ck"), tag="x"))
    report = dict(e.last_save)
    nlinks = [os.stat(os.path.join(d, f)).st_nlink for d, _ds, fs in os.walk(tag) for f in fs]
    e.close()
    shutil.rmtree(os.path.join(root, "nvme"))
    e = _engine(1, 2, os.path.join(root, "nvme2"), seed=3)
    e.load_checkpoint(os.path.join(root, "ck"), tag="x")
    loaded = _global_moments(e)
    e.close()
    return {"report": report, "warned": [str(w.message) for w in caught], "nlinks": nlinks,
            "equal": all(np.array_equal(loaded[k], moments[k]) for k in moments)}


@pytest.mark.parametrize("how", ["link", "device"])
def test_another_file_system_falls_back_to_a_copy_and_says_so(tmp_path, how):
    (r,) = run_ranks(_cross_fs_phase, 1, str(tmp_path), how, timeout=300)
    rep = r["report"]
    assert r["equal"] and set(r["nlinks"]) == {1}, r
    if how == "link":  # EXDEV at link time: each swap file copied by the kernel, as an extent
        assert rep["mode"] == "shared" and rep["files_copied"] > 0 and rep["files_hardlinked"] == 0, rep
        assert "cross-device" in rep["fallback"] and rep["bytes_copied"] > 0, rep
    else:  # known before anything is written: the chunked layout, through host memory
        assert rep["mode"] == "copy" and "another file system" in rep["fallback"], rep
    assert any("copied" in w for w in r["warned"]), r["warned"]


def test_swap_store_never_writes_in_place_over_a_linked_chunk(tmp_path):
    """The store's side alone: a hard link of a chunk file keeps its bytes through later writes
    of the array (whole and partial), and the store reads back what it wrote."""
    from zeroio.io.store import TensorStore

    with TensorStore(tmp_path / "swap", private=True) as store:
        store.create("a", 3000, torch.float32, chunk_elems=1024)
        first = torch.arange(3000, dtype=torch.float32)
        store.write("a", first).result()
        (path, _lo, _n), *_ = store.chunk_files("a")

        def link(name):
            os.link(path, tmp_path / name)
            with open(tmp_path / name, "rb") as fh:
                return fh.read()

        kept = link("kept")
        store.write("a", -first).result()  # whole chunks
        kept2 = link("kept2")
        store.write("a", torch.full((10,), 7.0), offset=5).result()  # read-modify-write
        for name, old in (("kept", kept), ("kept2", kept2)):
            with open(tmp_path / name, "rb") as fh:
                assert fh.read() == old, name
            assert os.stat(tmp_path / name).st_nlink == 1
        assert kept2 != kept and os.stat(path).st_nlink == 1
        want = -first
        want[5:15] = 7.0
        assert torch.equal(store.read("a").result(), want)
        assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]
