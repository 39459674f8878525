"""What a checkpoint refuses to trust or to touch, without an engine.

- tags that are not one folder name are refused before anything is touched;
- the manifest's own checksum, its index (entries must tile each array) and its array names
  are checked before a byte is read: a tampered offset or a `../../evil` array is a
  CheckpointError naming the manifest, for load, consolidate and inspect --verify alike;
- damaged, truncated and deleted chunks, manifests and group metadata: the previous tag
  loads, or the error names the file and what to do;
- `zeroio inspect` / `consolidate` given a folder that is no checkpoint directory say so;
- inspect --verify holds a few chunks, not an array (peak RSS of a child process);
- files and folders of checkpoints and exports follow the umask, with no exceptions.

References: tensors rebuilt from seeds, raw bytes, google_crc32c, file modes from the umask.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import google_crc32c
import pytest
import torch

from zeroio.checkpoint import (
    CheckpointWarning,
    SaveOptions,
    Segment,
    ShardedState,
    build_index,
    consolidate,
    load_sharded,
    save_sharded,
    write_folder,
    write_safetensors,
)
from zeroio.cli.main import main
from zeroio.errors import CheckpointError

SHAPES = [("embed.weight", (7, 5)), ("block.w", (5, 5)), ("block.b", (5,)), ("head.w", (3, 5))]
INDEX = build_index(SHAPES)
TOTAL = sum(e.numel for e in INDEX.values())  # 80
OPTS = SaveOptions(chunk_bytes=64, progress=False)  # 16 fp32 elements a chunk: 5 chunks
KINDS = ("fp32", "exp_avg")


def ref(kind: str, seed: int) -> torch.Tensor:
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(10 * seed + len(kind)))


def state(seed: int) -> ShardedState:
    return ShardedState(index=dict(INDEX), arrays={k: [Segment(0, ref(k, seed).clone())] for k in KINDS},
                        scalars={"seed": seed}, meta={"stage": 2})


def template() -> tuple[ShardedState, dict[str, torch.Tensor]]:
    bufs = {k: torch.full((TOTAL,), float("nan")) for k in KINDS}
    return ShardedState(index=dict(INDEX), arrays={k: [Segment(0, b)] for k, b in bufs.items()}), bufs


def load_seed(root, tag=None) -> int:
    """Load ``tag`` and check every array against the seed its scalars name."""
    tmpl, bufs = template()
    seed = load_sharded(root, tag, tmpl).scalars["seed"]
    for k, b in bufs.items():
        assert torch.equal(b, ref(k, seed))
    return seed


def tree(path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def reseal(path) -> None:
    """Recompute a manifest's checksum by hand (crc32c of its canonical JSON without it): what a
    careful forger does, so the other checks are reached."""
    doc = json.loads(path.read_text())
    doc.pop("manifest_crc32c", None)
    doc["manifest_crc32c"] = google_crc32c.value(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(doc))


def edit(path, fn, seal: bool) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    if seal:
        reseal(path)


@pytest.fixture
def two(tmp_path):
    """Tags "old" (seed 0) and "new" (seed 1, `latest`)."""
    root = tmp_path / "ckpt"
    save_sharded(state(0), root, "old", options=OPTS)
    save_sharded(state(1), root, "new", options=OPTS)
    return root


def inspect_json(capsys, *args) -> tuple[int, dict]:
    rc = main(["inspect", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- tags


@pytest.mark.parametrize("tag", ["..", ".", "", "a/b", "../x", "/abs", ".hidden", "latest", "a\\b", "x\n", 5])
def test_bad_tag_is_refused_before_anything_is_touched(tmp_path, tag):
    root = tmp_path / "runs" / "ckpt"
    save_sharded(state(0), root, "good", options=OPTS)
    (tmp_path / "runs" / "unrelated.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint tag .* (is not allowed|not a string): a checkpoint "
                                              r"tag is one folder name"):
        save_sharded(state(1), root, tag, options=OPTS)
    assert tree(tmp_path) == before
    assert load_seed(root) == 0
    if isinstance(tag, str) and tag:
        with pytest.raises(CheckpointError, match="is not allowed"):
            load_sharded(root, tag, template()[0])


# ---------------------------------------------------------------- the manifest


def _shift_offset(doc):
    doc["model"]["index"][1][1] += 1


@pytest.mark.parametrize("seal", [False, True], ids=["edited", "edited-and-resealed"])
def test_tampered_index_offset_is_refused_everywhere(two, tmp_path, capsys, seal):
    man = two / "new" / "manifest.json"
    edit(man, _shift_offset, seal)
    why = r"does not tile the arrays: a gap at element 35" if seal else r"damaged or was edited"
    pattern = rf"{man}.*{why}" if not seal else rf"manifest {man}: the index {why}"
    with pytest.raises(CheckpointError, match=pattern):
        load_sharded(two, "new", template()[0])
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(two, "new")
    with pytest.raises(CheckpointError, match=pattern):
        write_safetensors(two, tmp_path / "out", "new", progress=False)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    rc, info = inspect_json(capsys, two, "--verify")
    bad = {t["tag"]: t for t in info["tags"]}["new"]
    assert rc == 1 and not bad["complete"] and "verified" not in bad and str(man) in bad["problem"]
    # a resume (no tag) takes the previous complete tag, and says why
    with pytest.warns(CheckpointWarning, match=r"`latest` names 'new', which is not a complete checkpoint"):
        assert load_seed(two) == 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d["arrays"]["fp32"].update(numel=2**62), r"array 'fp32' has 4611686018427387904 elements"),
    (lambda d: d["model"]["index"].__setitem__(3, ["head.w", 65, [2**20, 2**20]]), r"covers 1099511627841"),
    (lambda d: d["arrays"]["fp32"].update(chunk_elems=0), r"chunk_elems is 0"),
    (lambda d: d["model"]["index"].append(["block.b", 80, [0]]), r"'block.b' is listed twice"),
    (lambda d: d["model"]["index"][0].__setitem__(1, -1), r"offset of 'embed.weight' is -1"),
])
def test_crafted_sizes_are_a_checkpoint_error_not_an_allocation(two, capsys, change, message):
    man = two / "new" / "manifest.json"
    edit(man, change, seal=True)
    with pytest.raises(CheckpointError, match=message):
        load_sharded(two, "new", template()[0])
    rc, info = inspect_json(capsys, two, "--tag", "new", "--verify")
    assert rc == 1 and re.search(message, info["tags"][0]["problem"])


def test_huge_chunk_claim_is_checked_against_the_file_before_reading(two, capsys):
    """A consistent manifest claiming one 2**40-element chunk: the reader stats the file first."""
    man = two / "new" / "manifest.json"

    def one_huge_chunk(d):
        d["arrays"]["fp32"].update(chunk_elems=2**40, chunk_crc32c=[0])
    edit(man, one_huge_chunk, seal=True)
    with pytest.raises(CheckpointError, match=r"fp32/c/0 is truncated: needed 4398046511104 bytes, the file has 64"):
        load_sharded(two, "new", template()[0], verify_first=True)
    rc, info = inspect_json(capsys, two, "--tag", "new", "--verify")  # inspect sees zarr.json disagree first
    assert rc == 1 and "fp32/zarr.json does not match the manifest" in info["tags"][0]["problem"]


def test_array_names_in_the_manifest_never_leave_the_checkpoint(two, capsys):
    """`../../evil`: refused while parsing. A planted file with the right crc outside the
    checkpoint shows nothing was read from there (it would verify)."""
    evil = two.parent / "evil" / "c" / "0"
    evil.parent.mkdir(parents=True)
    evil.write_bytes(bytes(TOTAL * 4))  # one chunk of zeros, and its right crc below
    man = two / "new" / "manifest.json"
    original = man.read_text()
    for name in ("../../evil", ".."):
        def add(d, name=name):
            d["arrays"][name] = {"numel": TOTAL, "dtype": "float32", "chunk_elems": TOTAL,
                                 "chunk_crc32c": [google_crc32c.value(bytes(TOTAL * 4))]}
        man.write_text(original)
        edit(man, add, seal=True)
        with pytest.raises(CheckpointError, match=re.escape(f"array {name!r} must be one folder name")):
            load_sharded(two, "new", template()[0])
        rc, info = inspect_json(capsys, two, "--verify")
        assert rc == 1 and {t["tag"]: t["complete"] for t in info["tags"]} == {"old": True, "new": False}


# ---------------------------------------------------------------- damage at rest


def _flip(p):
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    p.write_bytes(bytes(raw))


def _truncate(p):
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


DAMAGE = {"flip": _flip, "truncate": _truncate, "delete": os.unlink}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_chunk_names_the_file_and_the_way_out(two, capsys, how):
    chunk = two / "new" / "exp_avg" / "c" / "2"
    DAMAGE[how](chunk)
    tmpl, bufs = template()
    want = {"flip": r"is corrupt: crc32c .*restore the file or load another tag", "truncate": "is truncated",
            "delete": "is missing"}[how]
    with pytest.raises(CheckpointError, match=rf"exp_avg/c/2.*{want}|chunk 2.*exp_avg/c/2 {want}"):
        load_sharded(two, None, tmpl, verify_first=True)
    assert all(torch.isnan(b).all() for b in bufs.values())  # verified first: nothing was written
    assert load_seed(two, "old") == 0
    rc, info = inspect_json(capsys, two, "--verify")
    assert rc == 1 and "exp_avg/c/2" in {t["tag"]: t for t in info["tags"]}["new"]["problem"]


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("what", ["manifest.json", "zarr.json"])
def test_damaged_manifest_or_group_metadata_falls_back_and_is_reported(two, capsys, how, what):
    path = two / "new" / what
    DAMAGE[how](path)
    with pytest.warns(CheckpointWarning, match=r"`latest` names 'new'.*newest complete tag 'old'"):
        assert load_seed(two) == 0  # a resume takes the previous tag
    with pytest.raises(CheckpointError, match=rf"{two / 'new'} is incomplete: .*{what}"):
        load_sharded(two, "new", template()[0])
    rc, info = inspect_json(capsys, two)
    tags = {t["tag"]: t for t in info["tags"]}
    assert rc == 1 and set(tags) == {"old", "new"} and not tags["new"]["complete"]  # listed, not omitted
    assert what in tags["new"]["problem"] and info["latest"] == "new" and "latest" in info["problem"]


def test_damaged_array_metadata_is_found_by_verify(two, capsys):
    _flip(two / "new" / "fp32" / "zarr.json")
    assert load_seed(two) == 1  # zeroio reads the arrays from the manifest, chunk crcs checked
    rc, info = inspect_json(capsys, two, "--verify")
    new = {t["tag"]: t for t in info["tags"]}["new"]
    assert rc == 1 and "fp32/zarr.json" in new["problem"]


def test_damaged_latest_falls_back_to_the_newest_complete_tag(two, capsys):
    (two / "latest").write_bytes(b"\xff\xfe")
    with pytest.warns(CheckpointWarning, match=r"no `latest` file; loading the newest complete tag 'new'"):
        assert load_seed(two) == 1
    rc, info = inspect_json(capsys, two)
    assert rc == 1 and "latest is not readable" in info["problem"]


# ---------------------------------------------------------------- what inspect / consolidate are given


def test_inspect_and_consolidate_say_what_to_pass(two, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    assert main(["inspect", str(empty)]) == 1
    err = capsys.readouterr()
    assert "(latest: -)" not in err.out and f"no zeroio checkpoint in {empty}" in err.err
    for argv in (["inspect", str(two / "new")], ["consolidate", str(two / "new"), str(tmp_path / "o")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"{two / 'new'} is the folder of checkpoint tag 'new'" in err
        assert f"pass its parent {two}, and --tag new" in err
    assert not (tmp_path / "o").exists()
    assert main(["inspect", str(two)]) == 0
    assert main(["consolidate", str(two), str(tmp_path / "o"), "--tag", "old", "--quiet"]) == 0
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "o" / "model.safetensors"))
    e = INDEX["block.w"]
    assert torch.equal(got["block.w"], ref("fp32", 0)[e.offset:e.offset + e.numel].view(e.shape))


def test_inspect_verify_memory_is_a_few_chunks_not_the_array(tmp_path):
    """Peak RSS (VmHWM, reset through /proc/self/clear_refs) of a child verifying a 64 MiB
    array of 1 MiB chunks: a whole-array read raises it by the array (+87 MiB measured),
    chunk by chunk by a few chunks and the reader threads' arenas (+22 MiB measured)."""
    n = 16 << 20
    big = tmp_path / "big"
    st = ShardedState(index=build_index([("w", (n,))]), arrays={"fp32": [Segment(0, torch.ones(n))]})
    save_sharded(st, big, "t", options=SaveOptions(chunk_bytes=1 << 20, progress=False))
    small = tmp_path / "small"
    save_sharded(state(0), small, "t", options=OPTS)
    code = f"""
from zeroio.cli.inspect_cmd import describe
def mib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) // 1024
describe({str(small)!r}, verify=True)  # warm: imports, pools, engine
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
before = mib("VmRSS:")
info = describe({str(big)!r}, verify=True)
assert info["tags"][0]["verified"], info
print(mib("VmHWM:") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    grew_mib = int(out.stdout.split()[-1])
    assert grew_mib < 40, f"inspect --verify of a 64 MiB array raised the peak RSS by {grew_mib} MiB"


# ---------------------------------------------------------------- file modes


@pytest.mark.parametrize("umask", [0o007, 0o022])
def test_every_file_and_folder_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        root = tmp_path / "ckpt"
        save_sharded(state(0), root, "t", options=OPTS)
        save_sharded(state(1), root, "t", options=OPTS)  # a re-save: the swapped-in copy too
        save_sharded(state(1), root, "u", options=SaveOptions(chunk_bytes=64, progress=False, direct=True))
        write_safetensors(root, tmp_path / "export", "t", progress=False)
        write_folder({"w": torch.ones(3)}, tmp_path / "folder", hf_config={"model_type": "x"})
    finally:
        os.umask(old)
    checked = 0
    for top in (root, tmp_path / "export", tmp_path / "folder"):
        for p in [top, *top.rglob("*")]:
            want = (0o777 if p.is_dir() else 0o666) & ~umask
            assert p.stat().st_mode & 0o777 == want, f"{p}: {oct(p.stat().st_mode & 0o777)}, umask {oct(umask)}"
            checked += 1
    names = {p.name for p in root.rglob("*")}
    assert {"latest", "manifest.json", "zarr.json", "rank-00000.json", "0"} <= names and checked > 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_seed(root, "t") == 1
