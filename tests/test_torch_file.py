"""zeroio.io.torch_file: a file torch.save wrote, read without running code.

- every tensor torch.load gives back (views at a storage offset, transposed, 0-d, empty, bf16,
  fp16, int64, bool, tied storages) comes back equal through `TensorRef.load` and by byte
  range through `TensorRef.read`; containers, torch.Size and dtypes too.
- a crafted pickle that runs code under torch.load / pickle (os.system, exec, a class of the
  test) is refused with a CheckpointError naming the callable and the file, and the code does
  not run (the marker file it would write stays absent; the same file under
  torch.load(weights_only=False) writes it, so the crafted file is real).
- a class is admitted only when the caller names it, and then as a Record (name, attributes).
- a damaged member fails `verify_member` (zip CRC-32); a legacy (non-zip) file is named.
"""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import pytest
import torch

from zeroio.errors import CheckpointError
from zeroio.io.torch_file import Record, TensorRef, read_torch_file, verify_member

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, generator=g)
    mat = torch.randn(5, 7, generator=g)
    return {
        "view": base[7:19],  # a storage offset
        "tied": base,  # the same storage as "view"
        "transposed": mat.t(),  # not contiguous
        "scalar": torch.tensor(4.0),
        "empty": torch.empty(0, 3),
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 3, generator=g).half(),
        "long": torch.arange(-5, 6),
        "bool": torch.tensor([True, False, True]),
    }


def test_tensors_and_containers_equal_torch_load(tmp_path):
    path = tmp_path / "t.pt"
    tensors = _tensors()
    torch.save({"t": tensors, "od": collections.OrderedDict(a=1, b=[2.5, "x", None]),
                "size": torch.Size([3, 4]), "set": {1, 2}, "dtype": torch.bfloat16, "tuple": (1, (2,))}, path)
    got = read_torch_file(path).obj
    want = torch.load(path, weights_only=True)
    for name, t in want["t"].items():
        ref = got["t"][name]
        assert isinstance(ref, TensorRef) and ref.dtype == t.dtype and ref.shape == tuple(t.shape)
        assert torch.equal(ref.load(), t), name
        flat = t.reshape(-1)
        for lo, n in ((0, flat.numel()), (min(1, flat.numel()), max(0, flat.numel() - 2)), (flat.numel(), 0)):
            assert torch.equal(ref.read(lo, n), flat[lo:lo + n]), (name, lo, n)
    assert got["t"]["view"].storage == got["t"]["tied"].storage and got["t"]["view"].offset == 7
    assert got["od"] == want["od"] and isinstance(got["od"], collections.OrderedDict)
    assert got["size"] == (3, 4) and got["set"] == {1, 2} and got["dtype"] is torch.bfloat16
    assert got["tuple"] == (1, (2,))
    with pytest.raises(CheckpointError, match="outside a tensor of 12"):
        got["t"]["view"].read(5, 8)


class _RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Execs:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class Plain:
    """A plain class of this module: its objects pickle as the class and their attributes."""

    def __init__(self):
        self.cur_scale, self.dynamic = 2.0, True


@pytest.mark.parametrize("payload,named", [(_RunsCode, r"posix\.system"), (_Execs, r"builtins\.exec")])
def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path, payload, named):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"weights": torch.ones(3), "optimizer_state_dict": payload(marker)}, path)
    with pytest.raises(CheckpointError, match=named) as e:
        read_torch_file(path)
    assert str(path) in str(e.value) and "never runs code" in str(e.value)
    assert not marker.exists()
    # the file is truly malicious: torch's full unpickler runs its payload
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_class_is_admitted_only_when_named_and_only_as_a_record(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"scaler": Plain()}, path)
    with pytest.raises(CheckpointError, match=r"test_torch_file\.Plain"):
        read_torch_file(path)
    rec = read_torch_file(path, {f"{Plain.__module__}.Plain": "Plain"}).obj["scaler"]
    assert isinstance(rec, Record) and not isinstance(rec, Plain)
    assert rec.qualname == "Plain" and rec.state == {"cur_scale": 2.0, "dynamic": True}


def test_a_deepspeed_file_that_would_run_code_is_refused_by_the_checkpoint_reader(tmp_path):
    from zeroio.checkpoint import deepspeed_load

    root = tmp_path / "ds"
    shutil.copytree(FIXTURE / "stage2", root)
    marker = tmp_path / "ran"
    victim = root / "step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCode(marker)}}, victim)
    with pytest.raises(CheckpointError, match=r"posix\.system") as e:
        deepspeed_load.find(root, None)
    assert str(victim) in str(e.value) and not marker.exists()


def test_damaged_truncated_and_legacy_files_are_named(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(1000, dtype=torch.float32)}, path)
    ref = read_torch_file(path).obj["w"]
    verify_member(ref.storage)
    raw = bytearray(path.read_bytes())
    raw[ref.storage.data_offset + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"member .*data/0 is damaged \(Bad CRC-32"):
        verify_member(ref.storage)
    path.write_bytes(bytes(raw[:ref.storage.data_offset + 64]))
    with pytest.raises(CheckpointError, match=str(path)):
        read_torch_file(path)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy format"):
        read_torch_file(legacy)
