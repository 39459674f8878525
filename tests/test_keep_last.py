"""Keeping the newest N checkpoints ([Note: keeping the newest N] in
zeroio/checkpoint/retention.py): `zeroio train --keep-last N` and the engine's
``checkpoint.keep_last``, like the Hugging Face Trainer's ``save_total_limit``.

Real training with saves: which tags are on disk afterwards (the newest N, by the order they
were written), that a folder zeroio did not write, an incomplete tag and the tag ``latest``
names survive, that the kept tags load, and that the disk pre-flight counts N (+ the one being
saved) instead of every save.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import zeroio
from zeroio.checkpoint.layout import LATEST, CheckpointWarning
from zeroio.checkpoint.retention import doomed_tags, prune_tags
from zeroio.testing.train_cli import run_train

TINY = ["--nproc", "1", "--seq-len", "32", "--micro-batch", "2", "--json"]


def _tags(ckpt: Path) -> set[str]:
    return {p.name for p in ckpt.iterdir() if p.is_dir()}


def test_train_keep_last_keeps_the_newest_and_what_zeroio_did_not_write(tmp_path, monkeypatch):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    first = run_train(out, [*TINY, "--steps", "6", "--stop-after", "2", "--save-every", "1"],
                      dict(__import__("os").environ))
    assert first["end_step"] == 2 and _tags(ckpt) == {"step1", "step2"}
    # a user's folder among the tags, one shaped like a tag (another tool's zarr group), and a
    # zeroio tag whose save was interrupted (marker, no manifest)
    (ckpt / "mine").mkdir()
    (ckpt / "mine" / "notes.txt").write_text("keep me")
    (ckpt / "step0").mkdir()
    (ckpt / "step0" / "zarr.json").write_text(json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (ckpt / "step-broken").mkdir()
    (ckpt / "step-broken" / "zarr.json").write_bytes((ckpt / "step1" / "zarr.json").read_bytes())
    foreign = {p: p.read_bytes() for d in ("mine", "step0", "step-broken")
               for p in (ckpt / d).rglob("*") if p.is_file()}

    second = run_train(out, [*TINY, "--steps", "6", "--save-every", "1", "--keep-last", "2",
                             "--resume"], dict(__import__("os").environ))
    assert second["start_step"] == 2 and second["end_step"] == 6
    assert _tags(ckpt) == {"step5", "step6", "mine", "step0", "step-broken"}
    assert (ckpt / LATEST).read_text().strip() == "step6"
    assert {p: p.read_bytes() for p in foreign} == foreign
    # the run's record of what it wrote lists no removed tag (a later fresh run deletes
    # only what is listed, and refuses over what is not)
    listed = json.loads((out / "zeroio-run.json").read_text())["files"]
    assert {k.split("/")[1] for k in listed if k.startswith("checkpoints/")} == \
        {"step5", "step6", LATEST}
    # the kept tags are whole: the final one is what the model was exported from
    from safetensors.torch import load_file

    from zeroio.checkpoint import consolidate

    model = load_file(Path(second["model_dir"]) / "model.safetensors")
    ref = consolidate(ckpt, "step6")
    assert model.keys() == ref.keys() and all(torch.equal(model[k], ref[k]) for k in ref)
    assert consolidate(ckpt, "step5").keys() == ref.keys()


def _engine(keep_last: int | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "checkpoint": {"keep_last": keep_last}}
    engine, *_ = zeroio.initialize(model=model, config=config)
    return engine


def _step(engine, i: int) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
    engine.backward(engine(x).square().mean())
    engine.step()


def test_engine_keep_last_after_each_save(tmp_path):
    engine = _engine(keep_last=2)
    (tmp_path / "theirs").mkdir()  # not a zeroio checkpoint: neither counted nor removed
    (tmp_path / "theirs" / "w.bin").write_bytes(b"\x00" * 10)
    removed = []
    for i in range(1, 5):
        _step(engine, i)
        engine.save_checkpoint(tmp_path, tag=f"t{i}")
        removed.append(engine.last_save["removed_tags"])
    assert removed == [[], [], ["t1"], ["t2"]]
    assert _tags(tmp_path) == {"t3", "t4", "theirs"}
    # t3 still loads, and holds the state after step 3: a fresh engine loads it and steps on
    # exactly as this engine did after its third step
    after3 = _engine(keep_last=None)
    after3.load_checkpoint(tmp_path, tag="t3")
    _step(after3, 4)
    assert all(torch.equal(a, b) for a, b in zip(after3.module.parameters(),
                                                  engine.module.parameters(), strict=True))
    engine.close()
    after3.close()


def test_the_tag_latest_names_is_never_removed(tmp_path):
    """A user who rolled `latest` back to an old tag (DeepSpeed users edit that file) keeps
    it: it is spared even where it is beyond the newest N."""
    engine = _engine(keep_last=None)  # every tag stays while saving
    for i in range(1, 4):
        _step(engine, i)
        engine.save_checkpoint(tmp_path, tag=f"t{i}")
    assert engine.last_save["removed_tags"] == []
    engine.close()
    (tmp_path / LATEST).write_text("t1\n")
    assert doomed_tags(tmp_path, 1) == ["t2"]
    assert prune_tags(tmp_path, 1) == ["t2"]
    assert _tags(tmp_path) == {"t1", "t3"}
    with pytest.raises(ValueError, match="keep must be >= 1"):
        doomed_tags(tmp_path, 0)


def test_a_tag_holding_a_foreign_file_is_emptied_but_kept_with_a_warning(tmp_path):
    engine = _engine(keep_last=None)
    for i in range(1, 3):
        _step(engine, i)
        engine.save_checkpoint(tmp_path, tag=f"t{i}")
    engine.close()
    (tmp_path / "t1" / "README").write_text("mine")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert prune_tags(tmp_path, 1) == []  # not removed whole: not reported as removed
    assert any(issubclass(w.category, CheckpointWarning) and "README" in str(w.message)
               for w in seen)
    assert (tmp_path / "t1" / "README").read_text() == "mine"
    assert not (tmp_path / "t1" / "manifest.json").exists()  # no longer a checkpoint
    assert _tags(tmp_path) == {"t1", "t2"}


def test_keep_last_is_refused_below_one_and_against_a_config(tmp_path):
    from zeroio.cli.train.run_config import with_keep_last
    from zeroio.config import load_config
    from zeroio.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.keep_last"):
        load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"keep_last": 0}})
    raw = {"checkpoint": {"keep_last": 5}}
    with pytest.raises(ConfigError, match="--keep-last 3 contradicts checkpoint.keep_last = 5"):
        with_keep_last(raw, 3, "--config ds.json")
    assert with_keep_last(raw, 5, "--config ds.json") == raw
    assert with_keep_last({}, 3, None) == {"checkpoint": {"keep_last": 3}}


def test_preflight_counts_the_kept_checkpoints(tmp_path):
    """1,000 steps at --save-every 50: 20 checkpoints without --keep-last; with --keep-last 3
    the 3 kept ones (training and export) and, while training, the one being saved."""
    from transformers import LlamaForCausalLM

    from zeroio.cli.train import disk
    from zeroio.cli.train.options import TrainOptions, check_job
    from zeroio.cli.train.presets import llama_config

    params = sum(p.numel() for p in LlamaForCausalLM(llama_config("tiny")).parameters())
    chunk = (64 << 20) // 4  # fp32 elements per 64 MiB chunk, the last one padded whole
    one = 3 * -(-params // chunk) * chunk * 4  # fp32 masters + exp_avg + exp_avg_sq

    def plan(keep: int | None):
        opts = TrainOptions(output=str(tmp_path / "run"), steps=1000, save_every=50,
                            keep_last=keep)
        mcfg, cfg = check_job(opts, 1, cuda=False)
        assert cfg.checkpoint.keep_last == keep
        return disk.plan(out=tmp_path / "run", mcfg=mcfg, cfg=cfg, world_size=1, start=0,
                         end=1000, save_every=50, keep_last=cfg.checkpoint.keep_last,
                         checkpoint=True, write_model=True, model_dtype="fp32", fresh=True)

    every, kept = plan(None), plan(3)
    rest_train = every.phase_bytes("train") - 20 * one
    rest_export = every.phase_bytes("export") - 20 * one
    assert kept.phase_bytes("train") == rest_train + 4 * one  # 3 kept + 1 being saved
    assert kept.phase_bytes("export") == rest_export + 3 * one
    assert "checkpoints" in kept.breakdown() and "(3 x" in kept.breakdown()
    assert not (tmp_path / "run").exists()
