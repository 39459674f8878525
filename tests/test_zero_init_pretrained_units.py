"""The pieces under partitioned ``from_pretrained``, in one process.

- ``SafetensorsReader.read_range`` returns exactly the elements the ``safetensors``
  library reads for the same tensor (f32, bf16, f16, i64, an empty tensor), from a
  single file and from a sharded folder's index; a truncated or inconsistent file is
  a ``CheckpointError`` naming the file.
- zero.Init reads a seed-style config whose values are "auto" (``load_config`` of the
  same dict, with no Trainer values, is the ConfigError users hit), fills the bucket
  keys from ``hidden_size`` by Hugging Face's rule when given and takes DeepSpeed's
  defaults otherwise; a wrong stage or an unknown key is still refused.
- one process (no process group): the loaded model equals the plain load.
"""

from __future__ import annotations

import json

import pytest
import torch

from zeroio.errors import CheckpointError, ConfigError
from zeroio.io.safetensors_reader import SafetensorsReader


def _tensors():
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(7, 13, generator=g),
            "b": torch.randn(5, 9, generator=g).to(torch.bfloat16),
            "c": torch.randn(33, generator=g).half(),
            "d": torch.randint(-9, 9, (4, 3, 2), generator=g),
            "e": torch.zeros(0, 4)}


def test_read_range_equals_the_safetensors_library(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    ts = _tensors()
    save_file({k: ts[k] for k in "abc"}, str(tmp_path / "s1.safetensors"))
    save_file({k: ts[k] for k in "de"}, str(tmp_path / "s2.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "s1.safetensors" if k in "abc" else
                                            "s2.safetensors" for k in ts}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    g = torch.Generator().manual_seed(1)
    with SafetensorsReader.open(tmp_path) as r:
        assert sorted(r.keys()) == sorted(ts)
        for key, t in ts.items():
            f = "s1" if key in "abc" else "s2"
            with safe_open(str(tmp_path / f"{f}.safetensors"), framework="pt") as lib:
                ref = lib.get_tensor(key).reshape(-1)
            assert r.shape(key) == tuple(t.shape) and r.dtype(key) == t.dtype
            assert torch.equal(r.read(key), t)
            for _ in range(5):
                lo = int(torch.randint(0, ref.numel() + 1, (1,), generator=g))
                n = int(torch.randint(0, ref.numel() - lo + 1, (1,), generator=g))
                got = r.read_range(key, lo, n)
                assert got.dtype == ref.dtype and torch.equal(got, ref[lo:lo + n]), key
        out = torch.empty(4, dtype=torch.bfloat16)
        assert r.read_range("b", 3, 4, out=out) is out
        assert torch.equal(out, ts["b"].reshape(-1)[3:7])
        assert r.stats.largest_read_bytes <= ts["a"].numel() * 4
        with pytest.raises(CheckpointError, match="outside"):
            r.read_range("a", 90, 2)
        with pytest.raises(CheckpointError, match="not in the safetensors files"):
            r.read_range("zz")


def test_bad_files_are_checkpoint_errors(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="m.safetensors.*truncated"):
        SafetensorsReader([path])
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsReader([path])
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointError, match="'a' is in both"):
        SafetensorsReader([tmp_path / "x.safetensors", tmp_path / "y.safetensors"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty holds neither model.safetensors"):
        SafetensorsReader.open(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="cannot open safetensors file .*nothing_here"):
        SafetensorsReader.open(tmp_path / "nothing_here")


def _seed_auto(**top):
    from test_zero_init_pretrained import SEED_AUTO

    return dict(SEED_AUTO, **top)


def test_zero_init_reads_a_seed_auto_config():
    import zeroio
    from zeroio.config import load_init_config

    with pytest.raises(ConfigError, match='"auto" but load_config was not given'):
        zeroio.load_config(_seed_auto())  # what zero.Init raised before
    init = zeroio.zero.Init(config=_seed_auto())
    zero = init.config.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (500_000_000, 50_000_000, 100_000)
    assert init.dtype is None  # bf16 "auto": the model's own dtype
    assert zeroio.zero.Init(config=_seed_auto(bf16={"enabled": True})).dtype == torch.bfloat16
    cfg = load_init_config(_seed_auto(), hidden_size=48)
    assert (cfg.zero_optimization.reduce_bucket_size,
            cfg.zero_optimization.stage3_prefetch_bucket_size,
            cfg.zero_optimization.stage3_param_persistence_threshold) == (48 * 48,
                                                                         int(0.9 * 48 * 48),
                                                                         480)
    bad = _seed_auto(zero_optimization={"stage": 2, "reduce_bucket_size": "auto"})
    with pytest.raises(ConfigError, match="stage 3"):
        zeroio.zero.Init(config=bad)
    typo = _seed_auto(zero_optimization={"stage": 3, "stage3_prefetch_bucket": "auto"})
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket"):
        zeroio.zero.Init(config=typo)


def test_one_process_load_equals_plain(tmp_path):
    from test_zero_init_pretrained import _load_and_compare, _save

    r = _load_and_compare(_save(tmp_path / "m", tied=True))
    assert not r["unequal"] and r["names"] and r["buffers"], r["unequal"]
    assert r["tied"] == (True, True) and r["safe_open_calls"] == 0
    assert r["info"][0] == r["info"][1]
    assert all(p == 0 and k == n for p, k, n in r["sizes"].values())


def test_base_and_head_checkpoints_cross_load_as_transformers(tmp_path):
    """The base-model prefix is removed or added as transformers does: a base model from a
    head checkpoint (lm_head unexpected), a head model from a base checkpoint (lm_head
    missing, initialised from the same seed as the plain load)."""
    from test_zero_init_pretrained import SEED_AUTO, _info, _save
    from transformers import LlamaForCausalLM, LlamaModel

    import zeroio

    head = _save(tmp_path / "head", tied=False)
    base = str(tmp_path / "base")
    LlamaForCausalLM.from_pretrained(head).model.save_pretrained(base)
    for cls, folder, key in ((LlamaModel, head, "unexpected_keys"),
                             (LlamaForCausalLM, base, "missing_keys")):
        torch.manual_seed(1)
        ref, ref_info = cls.from_pretrained(folder, output_loading_info=True)
        torch.manual_seed(1)
        with zeroio.zero.Init(config=SEED_AUTO):
            model, info = cls.from_pretrained(folder, output_loading_info=True)
        assert _info(info) == _info(ref_info) and _info(info)[key] == ["lm_head.weight"]
        named = dict(model.named_parameters())
        with zeroio.zero.GatheredParameters(list(named.values())):
            unequal = [n for n, p in ref.named_parameters() if not torch.equal(named[n], p)]
        assert not unequal, (cls.__name__, unequal)
