"""A load checks every value it will apply before it changes anything, and every JSON file is
read within limits ([Note: verify every value before apply] in
zeroio/checkpoint/scalars_check.py, [Note: bounded JSON] in zeroio/jsonlimits.py).

Each crafted manifest is a real checkpoint's, one value changed and its crc recomputed
(google_crc32c over the canonical JSON, independently of zeroio), so it passes the crc check
as a buggy writer's or an edited file would. References: the engine's own state before each
failed load (masters, moments, parameters, counters, scaler, scheduler, buffer, RNG: bit for
bit), and an engine that trained the same steps without any failed load. A client_state
nested 100,000 deep must be one line naming the file in load_checkpoint, ``zeroio inspect``,
``zeroio consolidate`` and recover.py, never a RecursionError.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

from zeroio.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4


class _Net(torch.nn.Module):
    """A small MLP with a persistent buffer (the kind of state a checkpoint's scalars carry)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(),
                                        torch.nn.Linear(24, 5))
        self.register_buffer("shift", torch.linspace(-1, 1, 5))

    def forward(self, x):
        return self.body(x) + self.shift


def _engine():
    import torch.distributed as dist

    import zeroio

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(),
           "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                         "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": 2}}
    engine, *_ = zeroio.initialize(model=_Net(), config=cfg)
    engine.show_progress = False
    return engine


def _train(engine, steps) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per, out = BATCH // world, []
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]),
                                            y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        with torch.no_grad():  # the buffer moves too: a load must restore it
            engine.module.shift.add_(0.01)
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        out.append(t.item())
    return out


def _snapshot(engine) -> dict:
    """Everything a load may change, as plain values."""
    opt = engine.optimizer
    tensors = {f"{kind}{g.group_index}": opt.local_tensor(g.group_index, kind).clone().numpy()
               for g in engine.partitioner.groups for kind in ("fp32", "exp_avg", "exp_avg_sq")}
    tensors.update({n: p.detach().clone().numpy() for n, p in engine.module.named_parameters()})
    tensors["shift"] = engine.module.shift.clone().numpy()
    tensors["rng"] = torch.get_rng_state().numpy().copy()
    scalars = {"counters": (engine.global_steps, engine.micro_steps, engine.global_samples,
                            engine.skipped_steps, engine.last_grad_norm),
               "lr": engine.get_lr(), "groups": [{k: v for k, v in g.items() if k != "params"}
                                                 for g in opt.param_groups],
               "scaler": engine.loss_scaler.state_dict(),
               "sched": engine.lr_scheduler.state_dict(),
               "steps": [opt.steps_taken(g.group_index) for g in engine.partitioner.groups]}
    return {"tensors": tensors, "scalars": scalars}


def _same(a: dict, b: dict) -> bool:
    return a["scalars"] == b["scalars"] and a["tensors"].keys() == b["tensors"].keys() and \
        all(np.array_equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])


def _recrc(doc: dict) -> dict:
    body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "manifest_crc32c": google_crc32c.value(text)}


def _set(doc: dict, path: list, value) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


CRAFTED = {
    "dtype load": (["scalars", "buffers", "shift", "dtype"], "load",
                   "scalars.buffers['shift'].dtype"),
    "dtype size": (["scalars", "buffers", "shift", "dtype"], "float64",
                   "scalars.buffers['shift'].data"),
    "buffer shape": (["scalars", "buffers", "shift", "shape"], [6],
                     "scalars.buffers['shift'].shape"),
    "rng garbage": (["rank_scalars", 1, "rng", "torch_cpu"], "AAAA",
                    "rank_scalars.rng"),
    "empty loss scaler": (["scalars", "loss_scaler"], {}, "scalars.loss_scaler.cur_scale"),
    "string lr": (["scalars", "optimizer", "param_groups", 0, "lr"], "0.1",
                  "scalars.optimizer.param_groups[0].lr"),
    "short betas": (["scalars", "optimizer", "param_groups", 0, "betas"], [0.9],
                    "scalars.optimizer.param_groups[0].betas"),
    "nan eps": (["scalars", "optimizer", "param_groups", 0, "eps"], float("nan"),
                "scalars.optimizer.param_groups[0].eps"),
    "scheduler key": (["scalars", "lr_scheduler", "optimizer"], 5,
                      "scalars.lr_scheduler.optimizer"),
    "scheduler string": (["scalars", "lr_scheduler", "last_batch_iteration"], "7",
                         "scalars.lr_scheduler.last_batch_iteration"),
    "negative steps": (["scalars", "engine", "global_steps"], -1, "scalars.engine.global_steps"),
    "step count": (["scalars", "optimizer", "steps", 0], "x", "scalars.optimizer.steps[0]"),
    "group count": (["scalars", "optimizer", "param_groups"], [], "scalars.optimizer.param_groups"),
}
"""What is changed in the manifest -> (key path in the document, value, key the error names)."""


def _crafted_phase(root):
    import torch.distributed as dist

    from zeroio.errors import CheckpointError

    rank = dist.get_rank()
    ck = os.path.join(root, "ck")
    ref = _engine()
    straight = _train(ref, range(5))
    ref_params = {n: p.detach().clone().numpy() for n, p in ref.module.named_parameters()}
    ref.close()

    e = _engine()
    first = _train(e, range(2))
    e.save_checkpoint(ck, tag="good")
    first += _train(e, range(2, 3))  # the engine is a step past the checkpoint
    manifest = Path(ck, "good", "manifest.json")
    original = manifest.read_bytes()
    errors = {}
    for case, (path, value, _key) in CRAFTED.items():
        before = _snapshot(e)
        dist.barrier()
        if rank == 0:
            doc = json.loads(original)
            _set(doc, path, value)
            manifest.write_text(json.dumps(_recrc(doc)))
        dist.barrier()
        err = None
        try:
            e.load_checkpoint(ck, tag="good")
        except CheckpointError as exc:
            err = str(exc)
        errors[case] = {"err": err, "unchanged": _same(before, _snapshot(e))}
        dist.barrier()
        if rank == 0:
            manifest.write_bytes(original)
    rest = _train(e, range(3, 5))  # no failed load changed anything
    params = {n: p.detach().clone().numpy() for n, p in e.module.named_parameters()}
    e.close()
    return {"errors": errors, "straight": straight, "losses": first + rest,
            "equal": all(np.array_equal(params[n], v) for n, v in ref_params.items())}


def test_a_crafted_manifest_with_its_crc_recomputed_leaves_the_engine_unchanged(tmp_path):
    results = run_ranks(_crafted_phase, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        for case, (_path, _value, key) in CRAFTED.items():
            err, unchanged = r["errors"][case]["err"], r["errors"][case]["unchanged"]
            assert err is not None, (rank, case, "the load was accepted")
            assert "\n" not in err, (case, err)
            if case == "rng garbage" and rank == 0:  # rank 1's RNG state: rank 0 passed it
                assert "failed on another rank" in err and "unchanged" in err, err
            else:
                assert key in err and "nothing was loaded" in err, (rank, case, err)
            assert unchanged, (rank, case, err)
        assert r["losses"] == r["straight"], (r["losses"], r["straight"])
    assert results[0]["equal"]


# ---- a client_state nested 100,000 deep ---------------------------------------------------

DEEP = 100_000


def _save_phase(root):
    e = _engine()
    _train(e, range(1))
    e.save_checkpoint(os.path.join(root, "ck"), tag="t", client_state={"note": "flat"})
    e.close()


def _deepen(manifest: Path) -> None:
    """The manifest's client_state nested ``DEEP`` lists deep, its crc recomputed on the
    canonical text built by hand (json.dumps itself cannot nest that deep)."""
    doc = json.loads(manifest.read_bytes())
    doc.pop("manifest_crc32c")
    doc["client_state"] = {"x": "@DEEP@"}
    deep = "[" * DEEP + "]" * DEEP
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).replace('"@DEEP@"', deep)
    doc["manifest_crc32c"] = google_crc32c.value(canonical.encode())
    manifest.write_text(json.dumps(doc).replace('"@DEEP@"', deep))


def _load_deep_phase(root):
    from zeroio.errors import CheckpointError

    e = _engine()
    err = None
    try:
        e.load_checkpoint(os.path.join(root, "ck"), tag="t")
    except CheckpointError as exc:
        err = f"{type(exc).__name__}: {exc}"
    e.close()
    return err


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    run_ranks(_save_phase, 1, str(root))
    _deepen(root / "ck" / "t" / "manifest.json")
    return root


def test_a_deep_client_state_is_one_line_in_load_checkpoint(deep_ckpt):
    (err,) = run_ranks(_load_deep_phase, 1, str(deep_ckpt), timeout=300)
    assert err is not None and err.startswith("CheckpointError: "), err
    assert "nested deeper than 100 levels" in err and "manifest.json" in err, err
    assert "\n" not in err


@pytest.mark.parametrize("command", ["inspect", "consolidate"])
def test_a_deep_client_state_is_one_line_in_inspect_and_consolidate(deep_ckpt, tmp_path, capsys,
                                                                    command):
    from zeroio.cli.main import main

    args = [str(deep_ckpt / "ck")] + ([str(tmp_path / "out")] if command == "consolidate" else [])
    rc = main([command, *args])
    out, err = capsys.readouterr()
    assert rc == 1, (rc, out, err)
    # inspect lists the tag as invalid with the reason; consolidate's error is one line
    said = [ln for ln in (out + err).splitlines() if "nested deeper than 100 levels" in ln]
    assert len(said) == 1 and "manifest.json" in said[0], (out, err)
    assert "Traceback" not in out + err
    if command == "consolidate":
        assert len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_a_deep_client_state_is_one_line_in_recover(deep_ckpt, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "zeroio" / "io" / "recover.py"),
                           str(deep_ckpt / "ck"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "nested deeper than 100 levels" in proc.stderr and "manifest.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_deep_client_state_is_refused_at_save_not_written(tmp_path):
    (err,) = run_ranks(_save_deep_phase, 1, str(tmp_path), timeout=300)
    assert err is not None and "nested deeper than 100 levels" in err, err
    assert not (tmp_path / "ck" / "t").exists()


def _save_deep_phase(root):
    from zeroio.errors import CheckpointError

    state: list = []
    for _ in range(DEEP):
        state = [state]
    e = _engine()
    err = None
    try:
        e.save_checkpoint(os.path.join(root, "ck"), tag="t", client_state={"x": state})
    except CheckpointError as exc:
        err = str(exc)
    e.close()
    return err


# ---- the bounded reader itself ------------------------------------------------------------


def test_the_bounded_reader_counts_brackets_outside_strings_and_refuses_past_its_limits():
    from zeroio import jsonlimits

    tricky = {"a": ["]]]", "[[[{{{", 'say \\"[\\"'], "b": {"c": [1, [2, [3]]]}}
    text = json.dumps(tricky)
    assert jsonlimits.loads(text, "doc") == json.loads(text)  # Python's parser: the reference
    at_limit = "[" * jsonlimits.MAX_DEPTH + "]" * jsonlimits.MAX_DEPTH
    assert jsonlimits.loads(at_limit, "doc") == json.loads(at_limit)
    with pytest.raises(jsonlimits.JSONLimitError, match="doc is nested deeper than 100 levels"):
        jsonlimits.loads("[" + at_limit + "]", "doc")
    inside = json.dumps(["[" * 500])  # brackets in a string are no nesting
    assert jsonlimits.loads(inside, "doc") == ["[" * 500]
    with pytest.raises(jsonlimits.JSONLimitError, match="over the 10 bytes"):
        jsonlimits.loads('"0123456789"', "doc", max_bytes=10)
