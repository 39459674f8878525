"""zeroio train's data: byte tokenizer, text sources, token blocks, resumable sharded order; presets."""

from __future__ import annotations

import pytest
import torch

from zeroio.cli.train.data import (
    ByteTokenizer,
    ShardedOrder,
    TokenBlocks,
    builtin_corpus,
    read_text,
)
from zeroio.cli.train.presets import PRESETS, llama_config, num_parameters
from zeroio.errors import ConfigError


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "naïve café — 水 🙂"
    ids = tok.encode(text)
    assert ids.dtype == torch.long
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


def test_builtin_corpus_is_text_of_useful_size():
    data = builtin_corpus()
    assert len(data) > 10_000
    data.decode("utf-8")  # valid UTF-8, raises otherwise
    assert read_text(None) == data


def test_read_text_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.md").write_bytes(b"first")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.txt").write_bytes(b"third")
    assert read_text(tmp_path / "b.txt") == b"second"
    # sorted path order, blank line between files, non-text files skipped
    assert read_text(tmp_path) == b"first\n\nsecond\n\nthird"
    with pytest.raises(ConfigError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no text files"):
        read_text(empty)


def test_token_blocks_cut_the_stream_without_overlap():
    tokens = torch.arange(103)
    ds = TokenBlocks(tokens, 10)
    assert len(ds) == 10
    assert ds[3]["input_ids"].tolist() == list(range(30, 40))
    assert torch.equal(ds[3]["labels"], ds[3]["input_ids"])
    b = ds.batch([0, 9])
    assert b["input_ids"].tolist() == [list(range(0, 10)), list(range(90, 100))]
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        TokenBlocks(torch.arange(5), 10)


def test_sharded_order_is_disjoint_and_covers_each_epoch():
    world, mb, n = 3, 2, 20  # 20 // 6 = 3 steps per epoch, 2 blocks dropped
    orders = [ShardedOrder(num_blocks=n, world_size=world, rank=r, micro_batch=mb, seed=7)
              for r in range(world)]
    assert orders[0].steps_per_epoch == 3
    for epoch in range(2):
        seen = []
        for step in range(epoch * 3, epoch * 3 + 3):
            per_rank = [set(o.indices(step)) for o in orders]
            assert all(len(s) == mb for s in per_rank)
            assert set.intersection(*per_rank) == set()
            seen.extend(i for s in per_rank for i in s)
        assert len(seen) == len(set(seen)) == 18  # no block twice in one epoch
        assert set(seen) <= set(range(n))
    # a new epoch is a new permutation
    assert [orders[0].indices(s) for s in range(3)] != [orders[0].indices(s) for s in range(3, 6)]


def test_sharded_order_is_resumable_and_seeded():
    a = ShardedOrder(num_blocks=50, world_size=2, rank=1, micro_batch=4, seed=1)
    first = [a.indices(s) for s in range(20)]
    # a "restarted" object at step 11 gives the same batches from there on
    b = ShardedOrder(num_blocks=50, world_size=2, rank=1, micro_batch=4, seed=1)
    assert [b.indices(s) for s in range(11, 20)] == first[11:]
    # reference: the order is the seeded permutation dealt round-robin
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(1 + 0)).tolist()
    assert first[2] == perm[16:24][1::2]
    c = ShardedOrder(num_blocks=50, world_size=2, rank=1, micro_batch=4, seed=2)
    assert [c.indices(s) for s in range(5)] != first[:5]


def test_sharded_order_rejects_too_little_data():
    with pytest.raises(ConfigError, match="needs 8"):
        ShardedOrder(num_blocks=7, world_size=2, rank=0, micro_batch=4)


def test_presets_match_built_models_and_named_sizes():
    from transformers import LlamaForCausalLM

    for name in ("tiny", "small"):
        cfg = llama_config(name)
        model = LlamaForCausalLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)
    assert 1e5 < num_parameters(llama_config("tiny")) < 1e6
    one_b = llama_config("1b")
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.intermediate_size,
            one_b.num_attention_heads, one_b.vocab_size) == (2048, 24, 5632, 16, 32000)
    assert 1.3e9 < num_parameters(one_b) < 1.4e9
    assert set(PRESETS) >= {"tiny", "small", "125m", "350m", "1b", "7b", "13b"}


def test_model_config_path_and_errors(tmp_path):
    cfg = llama_config("tiny")
    cfg.save_pretrained(tmp_path)
    loaded = llama_config(model_config=tmp_path / "config.json")
    assert loaded.hidden_size == cfg.hidden_size and loaded.num_hidden_layers == 2
    assert llama_config(model_config=tmp_path).hidden_size == cfg.hidden_size  # a folder works too
    with pytest.raises(ConfigError, match="unknown --preset 'huge'"):
        llama_config("huge")
    with pytest.raises(ConfigError, match="does not exist"):
        llama_config(model_config=tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        llama_config(model_config=tmp_path / "bad.json")
