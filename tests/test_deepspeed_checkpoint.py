"""A run started on DeepSpeed continues on zeroio.

The fixture (tests/fixtures/deepspeed_ckpt, made by make_fixture.py on real DeepSpeed 0.19.8,
CPU, 2 gloo ranks) holds DeepSpeed's ZeRO stage 1, 2 and 3 checkpoints of a small tied
language model after 4 steps (and stage 2 and 3 ones with its LayerNorm frozen), and the
losses DeepSpeed went on to train to step 8. Here, with no DeepSpeed installed:

- zeroio loads each checkpoint at the same world size and stage, and at another (1 rank, the
  other stage), trains steps 5-8 on the same data with the same config, and its losses equal
  DeepSpeed's recorded ones. Tolerance: fp32 on the CPU; DeepSpeed reduces gradients in
  another order than zeroio (its bucketed all-reduce vs zeroio's reduce-scatter, or one batched
  backward on 1 rank), which moves sums by an ulp or two and Adam carries that on: measured
  <= 2 ulps (4.8e-7) over the four steps, asserted at 1e-6 relative. The control: loading the
  weights alone (fresh moments, step 0) misses DeepSpeed's losses by more than 1e-3.
- the masters, moments and step counts zeroio loaded equal DeepSpeed's tensors read
  independently (torch.load, DeepSpeed's partition rules applied here by hand), bit for bit;
  at stages 1-2 the masters also equal the module weights DeepSpeed saved (fp32 training).
- frozen parameters (frozen_param_shapes / _fragments) come back as DeepSpeed saved them.
- consolidate (API and CLI) gives those weights; inspect describes the checkpoint.
- layouts zeroio does not read, and a folder of neither kind, get an error naming what was found.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from zeroio.checkpoint import consolidate
from zeroio.errors import CheckpointError
from zeroio.testing import run_ranks
from zeroio.testing.training import rank_mean

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"
sys.path.insert(0, str(FIXTURE))
import tiny_lm  # noqa: E402  (the fixture's model, data and config)

GLOBAL_BATCH = tiny_lm.MICRO_BATCH * 2  # the fixture's 2 ranks
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _recorded(stage) -> dict:
    return json.loads((FIXTURE / f"stage{stage}" / "losses.json").read_text())


# ------------------------------------------------------------ DeepSpeed's files, read independently


class _Stub:
    """Stands in for DeepSpeed's classes (not installed here) when torch.load reads its files."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _StubUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _Stub if module.startswith("deepspeed.") else super().find_class(module, name)


_STUB_PICKLE = types.SimpleNamespace(Unpickler=_StubUnpickler, load=pickle.load, __name__="stub_pickle")


def _torch_load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_STUB_PICKLE)


def _reference(stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> name -> full tensor from DeepSpeed's files, by DeepSpeed's own partition rules."""
    tag = FIXTURE / f"stage{stage}" / "step4"
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    shapes = _torch_load(tag / model_file)["param_shapes"]
    opt = [_torch_load(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
           for r in range(2)]
    out = {k: {} for k in KINDS}
    for kind in KINDS:
        for g, group in enumerate(shapes):
            if stage == 3:  # each parameter: ceil(numel / 2) elements on each rank, in order
                flats = [o["fp32_flat_groups"][g] if kind == "fp32" else
                         o["optimizer_state_dict"]["state"][g][kind] for o in opt]
                at = 0
                for name, shape in group.items():
                    k = math.ceil(shape.numel() / 2)
                    out[kind][name] = torch.cat([f[at:at + k] for f in flats])[:shape.numel()].view(shape)
                    at += k
            else:  # the group's flat buffer, rank slices end to end (moments: padded slices)
                lean = [o["single_partition_of_fp32_groups"][g] for o in opt]
                moments = [o["base_optimizer_state"]["state"][g][kind] for o in opt] if kind != "fp32" else lean
                parts = [m[:len(s)] for m, s in zip(moments, lean, strict=True)]
                flat, at = torch.cat(parts), 0
                for i, (name, shape) in enumerate(group.items()):
                    out[kind][name] = flat[at:at + shape.numel()].view(shape)
                    at += shape.numel() + opt[0]["param_alignment_paddings"][g][i]
    return out


# ------------------------------------------------------------ zeroio, on gloo ranks


def _config(zero_stage: int, world: int) -> dict:
    cfg = tiny_lm.ds_config(zero_stage, world)
    cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH, GLOBAL_BATCH // world
    return cfg


def _continue(engine, rank: int, world: int) -> list[float]:
    """Train the batches after the save point; each step's loss averaged over the ranks."""
    per, losses = GLOBAL_BATCH // world, []
    for batch in tiny_lm.global_batches(2)[tiny_lm.SAVE_AT:]:
        loss = engine(batch[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(rank_mean(loss.item()))
    return losses


def _full(engine, kind: str) -> dict:
    """Every rank's ``kind`` put back per parameter (a test-side all-reduce, not zeroio's gather)."""
    import torch.distributed as dist

    flat = torch.zeros(engine.partitioner.index.total_numel, dtype=torch.float64)
    for g in engine.partitioner.groups:
        local = engine.optimizer.local_tensor(g.group_index, kind)
        for s in g.segments:
            piece = local[s.local_offset:s.local_offset + s.numel]
            flat[s.global_offset:s.global_offset + s.numel] = piece.double()
    dist.all_reduce(flat)
    # numpy: tensors would cross run_ranks' queue as handles of a process that has exited
    return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape).float().numpy()
            for e in engine.partitioner.index.entries}


def _resume(root: str, zero_stage: int, load_optimizer_states: bool = True) -> dict:
    """Load the DeepSpeed checkpoint into a fresh zeroio engine and train steps 5-8."""
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)  # not DeepSpeed's init: the weights must come from the checkpoint
    model = tiny_lm.TinyLM()
    with torch.no_grad():
        model.temperature.fill_(1.0)  # so must the buffer
    engine, *_ = zeroio.initialize(model=model, config=_config(zero_stage, world),
                                   model_parameters=tiny_lm.param_groups(model))
    path, client = engine.load_checkpoint(root, load_optimizer_states=load_optimizer_states)
    state = {k: _full(engine, k) for k in KINDS} if load_optimizer_states else {}
    out = {"path": path, "client": client, "state": state,
           "steps": [engine.optimizer.steps_taken(g.group_index) for g in engine.partitioner.groups],
           "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
           "scheduler": engine.lr_scheduler.state_dict(), "temperature": model.temperature.item()}
    out["losses"], out["global_steps"] = _continue(engine, rank, world), engine.global_steps
    return out


CASES = [(2, 2, 2), (3, 2, 3), (2, 1, 3), (3, 1, 2), (1, 1, 1)]  # (fixture stage, ranks, zeroio stage)


@pytest.mark.parametrize("ds_stage,world,zero_stage", CASES,
                         ids=[f"ds{a}-to-{b}ranks-zero{c}" for a, b, c in CASES])
def test_resumes_with_deepspeeds_losses_and_state(ds_stage, world, zero_stage):
    rec = _recorded(ds_stage)
    got = run_ranks(_resume, world, str(FIXTURE / f"stage{ds_stage}"), zero_stage)[0]
    assert got["path"] == str(FIXTURE / f"stage{ds_stage}" / "step4")
    assert got["losses"] == pytest.approx(rec["continuation_losses"], rel=1e-6, abs=0)
    # DeepSpeed's counters, scheduler and client state; the buffer it saved
    assert got["counters"] == (4, 4 * GLOBAL_BATCH, 0) and got["global_steps"] == rec["steps"]
    assert got["scheduler"] == {"last_batch_iteration": 3}
    assert got["client"] == {"epoch": 1, "tokens_seen": 4 * GLOBAL_BATCH * tiny_lm.SEQ, "data_order": [3, 1, 2]}
    assert got["temperature"] == 3.0
    assert got["steps"] == [4, 4]
    # the loaded masters and moments are DeepSpeed's, bit for bit, under every parameter name
    ref = _reference(ds_stage)
    for kind in KINDS:
        assert set(got["state"][kind]) == set(ref[kind])
        for name, want in ref[kind].items():
            assert torch.equal(torch.from_numpy(got["state"][kind][name]), want), (kind, name)


def test_weights_alone_miss_deepspeeds_losses():
    """The control: without DeepSpeed's moments and step counts the losses differ clearly."""
    rec = _recorded(2)
    got = run_ranks(_resume, 1, str(FIXTURE / "stage2"), 2, load_optimizer_states=False)[0]
    assert got["steps"] == [0, 0]
    assert max(abs(a - b) for a, b in zip(got["losses"], rec["continuation_losses"], strict=True)) > 1e-3


def _frozen_reference(stage: int) -> dict[str, torch.Tensor]:
    """The frozen LayerNorm as DeepSpeed saved it: whole (stage 2) or a padded slice per rank (3)."""
    tag = FIXTURE / f"stage{stage}_frozen" / "step4"
    if stage != 3:
        return dict(_torch_load(tag / "mp_rank_00_model_states.pt")["frozen_param_fragments"])
    frags = [_torch_load(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")["frozen_param_fragments"]
             for r in range(2)]
    return {n: torch.cat([f[n] for f in frags])[:65] for n in tiny_lm.FROZEN}


def _resume_frozen(root: str, zero_stage: int) -> dict:
    """As `_resume`, with the LayerNorm frozen (DeepSpeed's frozen_param_* metadata)."""
    import torch.distributed as dist

    import zeroio

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)
    model = tiny_lm.freeze(tiny_lm.TinyLM())
    engine, *_ = zeroio.initialize(model=model, config=_config(zero_stage, world),
                                   model_parameters=tiny_lm.param_groups(model))
    engine.load_checkpoint(root)
    with zeroio.zero.GatheredParameters(list(model.norm.parameters())):
        frozen = {f"norm.{n}": p.detach().clone().numpy() for n, p in model.norm.named_parameters()}
    return {"frozen": frozen, "losses": _continue(engine, rank, world)}


FROZEN_CASES = [(2, 2, 2), (3, 1, 3)]


@pytest.mark.parametrize("ds_stage,world,zero_stage", FROZEN_CASES,
                         ids=[f"ds{a}-to-{b}ranks-zero{c}" for a, b, c in FROZEN_CASES])
def test_frozen_parameters_come_back_and_training_follows_deepspeed(ds_stage, world, zero_stage):
    rec = _recorded(f"{ds_stage}_frozen")
    got = run_ranks(_resume_frozen, world, str(FIXTURE / f"stage{ds_stage}_frozen"), zero_stage)[0]
    for name, want in _frozen_reference(ds_stage).items():
        assert torch.equal(torch.from_numpy(got["frozen"][name]), want), name
    assert got["losses"] == pytest.approx(rec["continuation_losses"], rel=1e-6, abs=0)
    weights = consolidate(FIXTURE / f"stage{ds_stage}_frozen")
    assert set(weights) == {n for n, _ in tiny_lm.TinyLM().named_parameters()}
    assert all(torch.equal(weights[n], w) for n, w in _frozen_reference(ds_stage).items())


def test_stage12_masters_are_the_module_weights_deepspeed_saved():
    """fp32 training: DeepSpeed's module weights are its masters, a reference with no partition rule."""
    for stage in (1, 2):
        module = _torch_load(FIXTURE / f"stage{stage}" / "step4" / "mp_rank_00_model_states.pt")["module"]
        for name, want in _reference(stage)["fp32"].items():
            assert torch.equal(module[name], want), name


def test_consolidate_gives_the_weights(tmp_path, capsys):
    from safetensors.torch import load_file

    from zeroio.cli.main import main

    for stage in (2, 3):
        ref = _reference(stage)["fp32"]
        got = consolidate(FIXTURE / f"stage{stage}")
        assert list(got) == [n for n, _ in tiny_lm.TinyLM().named_parameters()]  # model order, tied once
        for name, want in ref.items():
            assert torch.equal(got[name], want), name
        out = tmp_path / f"out{stage}"
        assert main(["consolidate", str(FIXTURE / f"stage{stage}"), str(out), "--quiet"]) == 0
        files = load_file(str(out / "model.safetensors"))
        assert set(files) == set(ref) and all(torch.equal(files[n], ref[n]) for n in ref)
        model = tiny_lm.TinyLM()
        model.load_state_dict(files, strict=False)  # head.weight is tied to embed.weight
        assert torch.equal(model.head.weight, ref["embed.weight"])


def test_inspect_describes_it(capsys):
    from zeroio.cli.main import main

    assert main(["inspect", str(FIXTURE / "stage3"), "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (t,) = info["tags"]
    assert info["latest"] == "step4" and info["format"] == "deepspeed"
    assert (t["tag"], t["complete"], t["verified"], t["stage"], t["world_size"], t["global_steps"]) == \
        ("step4", True, True, 3, 2, 4)
    assert t["numel"] == sum(p.numel() for p in tiny_lm.TinyLM().parameters())
    assert t["writer"] == "DeepSpeed 0.19.8"
    assert t["client_state_keys"] == ["data_order", "epoch", "tokens_seen"]
    assert main(["inspect", str(FIXTURE / "stage2")]) == 0
    assert "with DeepSpeed 0.19.8 by 2 rank(s) at stage 2, step 4" in capsys.readouterr().out


# ------------------------------------------------------------ what is refused, and said


def _copy(tmp_path, stage: int = 2) -> Path:
    root = tmp_path / "ds"
    shutil.copytree(FIXTURE / f"stage{stage}", root)
    return root


def _find(root, tag=None):
    from zeroio.checkpoint import deepspeed_load

    return deepspeed_load.find(root, tag)


def test_a_damaged_file_is_named_before_anything_is_loaded(tmp_path):
    from zeroio.checkpoint.deepspeed_inspect import verify

    root = _copy(tmp_path)
    victim = root / "step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = bytearray(victim.read_bytes())
    fp32 = _find(root).optim[1]["single_partition_of_fp32_groups"][0].storage
    raw[fp32.data_offset + 5] ^= 0xFF  # one byte of rank 1's fp32 slice
    victim.write_bytes(bytes(raw))
    problem = verify(_find(root))
    assert problem is not None and str(victim) in problem and fp32.member in problem
    with pytest.raises(CheckpointError, match="damaged") as e:
        consolidate(root)
    assert str(victim) in str(e.value)


def _load_damaged(root):
    import zeroio

    model = tiny_lm.TinyLM()
    engine, *_ = zeroio.initialize(model=model, config=_config(2, 1),
                                   model_parameters=tiny_lm.param_groups(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        engine.load_checkpoint(root)
    except CheckpointError as e:
        same = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        return str(e), same, engine.global_steps
    return None, None, None


def test_a_damaged_file_fails_the_load_and_leaves_the_engine(tmp_path):
    root = _copy(tmp_path)
    victim = root / "step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    raw = bytearray(victim.read_bytes())
    at = _find(root).optim[0]["base_optimizer_state"]["state"][0]["exp_avg"].storage.data_offset
    raw[at] ^= 0xFF
    victim.write_bytes(bytes(raw))
    err, same, steps = run_ranks(_load_damaged, 1, root)[0]
    assert err is not None and str(victim) in err and "CRC" in err
    assert same and steps == 0


@pytest.mark.parametrize("layout,files,said", [
    ("pipeline", ["layer_01-model_00-model_states.pt"], "pipeline parallel"),
    ("tensor parallel", ["mp_rank_01_model_states.pt"], "tensor/model parallel"),
    ("moe", ["expp_rank_0_mp_rank_00_optim_states.pt"], "mixture of experts"),
    ("universal", ["zero/"], "universal checkpoint"),
])
def test_deepspeed_layouts_zeroio_does_not_serve_are_named(tmp_path, layout, files, said):
    root = _copy(tmp_path)
    for f in files:
        p = root / "step4" / f.rstrip("/")
        p.mkdir() if f.endswith("/") else p.write_bytes(b"")
    with pytest.raises(CheckpointError, match=said) as e:
        _find(root)
    assert str(root / "step4") in str(e.value) and "zero_to_fp32" in str(e.value)


def _tag(tmp_path, files: dict) -> Path:
    d = tmp_path / "other" / "t"
    d.mkdir(parents=True)
    for name, obj in files.items():
        torch.save(obj, d / name)
    return d.parent


MODEL_STATES = {"module": {}, "buffer_names": [], "optimizer": None, "param_shapes": [], "ds_version": "0.14.0"}


def test_stage0_bf16_zero_and_missing_optimizer_files_are_named(tmp_path):
    stage0 = _tag(tmp_path / "a", {"mp_rank_00_model_states.pt":
                                   {**MODEL_STATES, "optimizer": {"state": {}, "param_groups": []}}})
    with pytest.raises(CheckpointError, match="ZeRO stage 0"):
        _find(stage0, "t")
    bf16 = _tag(tmp_path / "b", {"mp_rank_00_model_states.pt": MODEL_STATES,
                                 "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt":
                                 {"optimizer_state_dict": {"fp32_groups": [], "partition_count": 1}}})
    with pytest.raises(CheckpointError, match="bf16_zero"):
        _find(bf16, "t")
    bare = _tag(tmp_path / "c", {"mp_rank_00_model_states.pt": MODEL_STATES})
    with pytest.raises(CheckpointError, match=r"\(\*_optim_states.pt, one per rank\) are missing"):
        _find(bare, "t")


def test_missing_rank_file_is_named(tmp_path):
    root = _copy(tmp_path)
    (root / "step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="partitioned over 2 ranks, but 1 optimizer files"):
        _find(root)


def test_tag_folder_and_wrong_tag_say_what_to_pass(tmp_path):
    root = _copy(tmp_path)
    with pytest.raises(CheckpointError, match=r"folder of DeepSpeed checkpoint tag 'step4'.*tag='step4'"):
        _find(root / "step4")
    with pytest.raises(CheckpointError, match=r"with tags \['step4'\], not 'step9'"):
        _find(root, "step9")
    assert _find(root, "../ds") is None  # not one folder: zeroio's reader names the tag rule
    (root / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no `latest` file"):
        _find(root)
    assert _find(root, "step4").stage == 2


def test_a_folder_of_another_layout_says_what_it_found(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        consolidate(hf)
    msg = str(e.value)
    assert "config.json, model.safetensors" in msg and "from_pretrained" in msg and "DeepSpeed" in msg


def test_another_model_is_refused_by_name(tmp_path):
    from zeroio.checkpoint import deepspeed_load
    from zeroio.checkpoint.state import build_index

    tag = _find(FIXTURE / "stage2")
    index = build_index([(n, tuple(p.shape)) for n, p in tiny_lm.TinyLM().named_parameters()])
    assert set(deepspeed_load.check_model(tag, index, strict=True).values()) == set(tag.shapes)
    index.pop("fc2.bias")
    with pytest.raises(CheckpointError, match=r"1 checkpoint parameter\(s\) not in the model \(e.g. \['fc2.bias"):
        deepspeed_load.check_model(tag, index, strict=True)
    assert "fc2.bias" not in deepspeed_load.check_model(tag, index, strict=False).values()
