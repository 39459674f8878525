"""The GPU's share of the host optimizer step (zeroio/shard/assist.py, [Note: step assist]).

CPU (here): ``zero_optimization.tiering.step_assist`` and ``ZEROIO_STEP_ASSIST`` resolve as
documented, bad values name the key, "on" without CUDA is an error naming the setting,
and an engine on the CPU builds no assist.

GPU (``-m gpu``): ``tiny_mlp`` with offload_optimizer cpu, the overlapped step on, chunks of
64 elements in slots of 32 (every GPU chunk takes two slots), against plain torch AdamW +
clip_grad_norm_ and against the same run with the assist off:

- stage 2 fp32 (torch's CPU Adam, fp32 host gradients) and bf16 (the one-pass kernel,
  bf16 host gradients); stage 3 bf16 with parameter offload (the GPU writes host shards);
- modes: "all" (a backlog no chunk reaches: every chunk on the GPU), "mixed" (a backlog of
  one chunk: the worker steps the next chunk itself while one is on the GPU) and off;
- the assist's element counts, the bytes it moved (14 per element up with a 16-bit
  gradient, 12 down), and a checkpoint saved right after an assisted step that loads into
  an engine without the assist with every state bit for bit (the GPU's writes reached host
  memory before the save read it);
- slots that do not fit the GPU (an out-of-memory error after some were made): one
  warning, the slots released, and the run equal bit for bit to the CPU-only one.

On the GPU machine:  python3 -m pytest -q -m gpu tests/test_step_assist.py
"""

from __future__ import annotations

import pytest
import test_stage12_ratio as r12  # noqa: I001 (tests/ is on sys.path under pytest)
import torch

from zeroio.config import load_config
from zeroio.config.zero import step_assist_enabled
from zeroio.errors import ConfigError
from zeroio.testing import run_ranks
from zeroio.testing.cuda import need_cuda
from zeroio.testing.models import tiny_mlp

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


# ---- configuration (CPU) ---------------------------------------------------------------------

def _tiering(value):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if value is not ...:
        zero["tiering"] = {"step_assist": value}
    return load_config({"train_micro_batch_size_per_gpu": 1,
                        "zero_optimization": zero}).zero_optimization.tiering


@pytest.mark.parametrize("value, cpu, cuda", [(..., False, True), ("auto", False, True),
                                              (None, False, True), (False, False, False),
                                              (True, None, True)])
def test_config_resolution(monkeypatch, value, cpu, cuda):
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    t = _tiering(value)
    assert step_assist_enabled(t, CUDA) is cuda
    if cpu is None:  # on, without CUDA
        with pytest.raises(ConfigError) as e:
            step_assist_enabled(t, CPU)
        assert e.value.key == "zero_optimization.tiering.step_assist"
        assert "false" in str(e.value)
    else:
        assert step_assist_enabled(t, CPU) is cpu


def test_auto_and_env(monkeypatch):
    """"auto" is on for CUDA at any world size (its 2-GPU NCCL tests pass);
    the environment variable wins over the config either way."""
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    assert step_assist_enabled(_tiering("auto"), CUDA) is True
    assert step_assist_enabled(_tiering("auto"), CPU) is False
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", "1")
    assert step_assist_enabled(_tiering(False), CUDA) is True
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", "0")
    assert step_assist_enabled(_tiering(True), CUDA) is False


@pytest.mark.parametrize("env, cuda", [("1", True), ("0", False), ("auto", True),
                                       ("no", False)])
def test_env_overrides_config(monkeypatch, env, cuda):
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", env)
    assert step_assist_enabled(_tiering(False), CUDA) is cuda
    assert step_assist_enabled(_tiering(True), CUDA) is cuda
    if cuda and env != "auto":
        with pytest.raises(ConfigError) as e:
            step_assist_enabled(_tiering(False), CPU)
        assert e.value.key == "zero_optimization.tiering.step_assist"
        assert "ZEROIO_STEP_ASSIST" in str(e.value)


def test_bad_values_name_the_key(monkeypatch):
    with pytest.raises(ConfigError) as e:
        _tiering("yes")
    assert e.value.key == "zero_optimization.tiering.step_assist"
    assert '"auto"' in str(e.value)
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", "maybe")
    with pytest.raises(ConfigError) as e:
        step_assist_enabled(_tiering(...), CUDA)
    assert e.value.key == "ZEROIO_STEP_ASSIST"


def _cpu_engine_body():
    import zeroio

    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=r12._config(2, 1.0, overlap=True))
    out = {"assist": engine.partitioner._assist is not None,
           "sources": sorted(engine.stats()["sources"])}
    engine.close()
    return out


def test_cpu_engine_has_no_assist(monkeypatch):
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    out, = run_ranks(_cpu_engine_body, 1, timeout=120)
    assert not out["assist"]
    assert not any("step_assist" in s for s in out["sources"])


# ---- GPU -------------------------------------------------------------------------------------

STEPS = 3
MODES = {"all": (1 << 40, 0), "mixed": (64, 0), "off": (None, 0),
         "resident": (1 << 40, None), "part": (64, "half"), "shrink": (1 << 40, None),
         "fallback": (1 << 40, None), "streamed": (1 << 40, None)}
"""mode -> (the assist's backlog, None: assist off; ``gpu_budget_bytes``: 0 none resident,
None "auto", "half": 12 bytes for half the host elements). "fallback": resident, and the
norm is taken over the host gradients (as when a group is reduced twice), which resident
gradients on the GPU must reach first ([Note: resident gradients] in shard/assist.py).
Where the GPU has room the placement keeps the whole gradient there and the host step
reads it through a window ([Note: the gradient's home] in zeroio/config/accum_place.py):
"streamed" runs so; the other modes with room keep the gradient in host memory (the rule
patched off), so the resident chunks' own gradient buffers are what they test."""


def _config(stage, dtype, budget=0):
    cfg = r12._config(stage, 1.0, overlap=True, dtype=dtype)
    cfg["zero_optimization"]["tiering"]["gpu_budget_bytes"] = budget
    if stage == 3:
        cfg["zero_optimization"].update(
            stage3_param_persistence_threshold=0,
            offload_param={"device": "cpu", "pin_memory": True})
    return cfg


def _states(engine):
    """Every group's local fp32 master and moments (host copies), in group order."""
    engine.synchronize()
    return [engine.optimizer.local_tensor(g.group_index, kind).detach().cpu().clone()
            for g in engine.partitioner.groups for kind in ("fp32", "exp_avg", "exp_avg_sq")]


def _gpu_body(stage, dtype, tmpdir):
    import os

    import zeroio
    from zeroio.partition import stage12
    from zeroio.shard import assist

    stage12.STEP_CHUNK_NUMEL = 64
    os.environ["ZEROIO_STEP_CHUNK_NUMEL"] = "64"
    assist.SLOT_NUMEL = 32
    os.environ["ZEROIO_CPU_ADAM"] = "compiled" if dtype == "bf16" else "torch"
    from zeroio import estimate

    rule = estimate.gradient_on_device
    host_numel = sum(p.numel() for p in tiny_mlp().parameters())  # one rank holds at most
    out = {}
    for mode, (backlog, budget) in MODES.items():
        estimate.gradient_on_device = rule if mode == "streamed" else (lambda *a, **k: False)
        os.environ["ZEROIO_STEP_ASSIST"] = "0" if backlog is None else "1"
        assist.BACKLOG_NUMEL = backlog or 1
        if budget == "half":
            budget = 12 * (host_numel // 2)
        engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(stage, dtype, budget))
        built = dict(engine.stats()["bytes_moved"])  # construction's copies: not the steps'
        if mode == "fallback" and hasattr(engine.partitioner, "landing"):
            engine.partitioner.landing.sq_norm = lambda: None
        if mode == "shrink":  # resident for two steps, then a budget of 0: all given back
            losses = r12._train(engine, STEPS - 1, 1, engine.device)
            held = engine.partitioner._assist.resident_bytes
            engine.partitioner._assist.gpu_budget_bytes = 0
            losses += r12._train(engine, 1, 1, engine.device, first_step=STEPS - 1)
        else:
            losses = r12._train(engine, STEPS, 1, engine.device)
        stats = engine.stats()
        counts = next((v for k, v in stats["sources"].items() if k.endswith("step_assist")),
                      None)
        res = {"losses": losses, "counts": dict(counts) if counts else None,
               "streamed": engine.partitioner.grads_streamed,
               "moved": {k: v - built.get(k, 0) for k, v in stats["bytes_moved"].items()},
               "budget": budget,
               "host_numel": sum(g.master.numel() for g in engine.partitioner.groups)}
        if mode == "shrink":
            res["held_before"] = held
        # local_tensor gives the resident chunks back (to be loaded again on their next step)
        res["states"] = [t.tolist() for t in _states(engine)]
        res["masters"] = r12._masters(engine).tolist() if stage < 3 else None
        if mode in ("all", "resident"):  # a checkpoint right behind an assisted step
            saved = _states(engine)
            engine.save_checkpoint(tmpdir, tag=mode)
            # training on after the save: the resident chunks load their state again
            res["after"] = r12._train(engine, 2, 1, engine.device, first_step=STEPS)
            res["after_counts"] = dict(engine.stats()["sources"][
                f"stage{'3' if stage == 3 else '12'}.step_assist"])
            engine.close()
            os.environ["ZEROIO_STEP_ASSIST"] = "0"
            other, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(stage, dtype))
            other.load_checkpoint(tmpdir, tag=mode)
            res["reload_equal"] = all(torch.equal(a, b) for a, b in zip(
                saved, _states(other), strict=True))
            res["after_reloaded"] = r12._train(other, 2, 1, other.device, first_step=STEPS)
            other.close()
        else:
            engine.close()
        out[mode] = res
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("stage, dtype", [(2, "fp32"), (2, "bf16"), (3, "bf16")])
@pytest.mark.parametrize("world", [1, 2])
def test_step_assist_matches_reference(tmp_path, stage, dtype, world):
    need_cuda(world)
    outs = run_ranks(_gpu_body, world, stage, dtype, str(tmp_path), timeout=300,
                     backend="nccl" if world > 1 else "gloo")
    ref_losses, ref_params = r12._reference(world, STEPS, 1)
    tight = dtype == "fp32"
    grad_bytes = 2 if dtype == "bf16" else 4
    for out in outs:
        off = out["off"]
        assert off["counts"] is None  # no assist, no source
        # stage 3's 16-bit host gradients of resident chunks land on the GPU from step 2 on
        grads_here = stage == 3 and dtype == "bf16"
        for mode in ("all", "mixed", "resident", "part", "shrink", "fallback"):
            got = out[mode]
            c = got["counts"]
            assert c["numel_gpu"] > 0, (mode, c)
            assert c["numel_gpu"] + c["numel_cpu"] == STEPS * got["host_numel"], (mode, c)
            if mode in ("all", "mixed"):
                assert c["numel_resident"] == 0 and c["resident_bytes"] == 0, (mode, c)
            if mode == "all":
                # stage 3 steps groups still gathered after the backward on the training
                # thread itself (they are re-gathered right after): those count as CPU
                assert c["numel_cpu"] == 0 or stage == 3, c
                # up: master and moments (12 bytes) and the host gradient; down: 12 bytes,
                # plus the 16-bit shard at stage 3
                assert got["moved"]["cpu->gpu"] >= (12 + grad_bytes) * c["numel_gpu"]
                assert got["moved"]["gpu->cpu"] >= 12 * c["numel_gpu"]
            per_step = c["numel_gpu"] // STEPS
            if mode == "resident":  # every GPU chunk stays: loaded once, then gradients only
                assert c["numel_resident"] == c["numel_gpu"], c
                assert c["resident_bytes"] == (12 + 2 * grads_here) * per_step, c
                assert c["resident_budget_bytes"] >= c["resident_bytes"], c
                streamed = out["all"]["moved"]
                assert got["moved"]["cpu->gpu"] < streamed["cpu->gpu"]
                assert got["moved"]["gpu->cpu"] < streamed["gpu->cpu"]
                # step 1 loads 12 bytes per element and the gradient; later steps send the
                # gradient up unless it landed on the GPU
                ups = 1 if grads_here else STEPS
                assert got["moved"]["cpu->gpu"] >= (12 + ups * grad_bytes) * per_step
                assert c["numel_grad_gpu"] == (STEPS - 1) * per_step * grads_here, c
                if grads_here:  # down: the 16-bit results of GPU chunks, and every
                    # gradient but those of resident chunks after step 1; and each step's
                    # gradient norm, one fp32 scalar
                    grads_down = STEPS * got["host_numel"] - (STEPS - 1) * per_step
                    assert got["moved"]["gpu->cpu"] <= 2 * c["numel_gpu"] + grad_bytes * (
                        grads_down) + 4 * STEPS, (got["moved"], c)
            if mode == "fallback":  # the gradients went back down before the host read them
                assert c["numel_resident"] == c["numel_gpu"] and c["numel_grad_gpu"] == 0, c
            assert got["streamed"] == (mode == "streamed"), mode
            if mode == "streamed":  # resident as above, the gradient read on the GPU: no
                # buffer of its own per chunk, and no gradient crosses PCIe up at all
                assert c["numel_resident"] == c["numel_gpu"] and c["numel_grad_gpu"] == 0, c
                assert c["resident_bytes"] == 12 * per_step, c
                ups = 1 if grads_here else STEPS  # the resident mode's gradients up
                assert got["moved"]["cpu->gpu"] <= \
                    out["resident"]["moved"]["cpu->gpu"] - ups * grad_bytes * per_step
            if mode == "part":  # capped: only what 12 bytes per element of it allow
                assert 0 < c["resident_bytes"] <= got["budget"], c
                assert c["numel_resident"] < c["numel_gpu"] + c["numel_cpu"], c
            if mode == "shrink":  # the budget went to 0 before the last step
                assert got["held_before"] > 0 and c["resident_bytes"] == 0, (got, c)
            if mode in ("all", "resident"):
                # the checkpoint read the GPU's state, bit for bit, and a run loaded from it
                # without the assist goes on as the one that saved it
                assert got["reload_equal"]
                assert got["after"] == pytest.approx(got["after_reloaded"],
                                                     rel=1e-5 if tight else 1e-2)
                if mode == "resident":
                    a = got["after_counts"]
                    assert a["numel_resident"] > c["numel_resident"], a
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-4 if tight else 3e-2)
            if got["masters"] is not None:
                err = (torch.tensor(got["masters"]) - ref_params).abs().max()
                assert err < (1e-4 if tight else 2e-2), (mode, err)
            # against the same run on the CPU alone: float32 rounding of the two kernels
            # (a bf16 forward can grow it to about one bf16 step of a parameter)
            for a, b in zip(got["states"], off["states"], strict=True):
                diff = (torch.tensor(a) - torch.tensor(b)).abs().max()
                assert diff < (1e-5 if tight else 5e-3), (mode, diff)
        assert off["losses"] == pytest.approx(ref_losses, rel=1e-4 if tight else 3e-2)


def _oom_body():
    import os
    import warnings

    import zeroio
    from zeroio.shard import assist

    real = assist.StepAssist._buf

    def no_room(self, k, name, dtype, n):  # the GPU fills up after some slot buffers
        if name == "v" and k == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, k, name, dtype, n)

    os.environ["ZEROIO_CPU_ADAM"] = "compiled"
    out = {}
    for mode in ("full", "off"):
        os.environ["ZEROIO_STEP_ASSIST"] = "1" if mode == "full" else "0"
        assist.StepAssist._buf = no_room
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = zeroio.initialize(model=tiny_mlp(), config=_config(2, "bf16"))
            losses = r12._train(engine, STEPS, 1, engine.device)
        assist.StepAssist._buf = real
        stats = engine.stats()
        out[mode] = {"losses": losses, "states": _states(engine),
                     "counts": stats["sources"].get("stage12.step_assist"),
                     "warned": [str(w.message) for w in caught if "step assist" in
                                str(w.message)],
                     "held_gpu": len(engine.partitioner._assist.held_tensors())
                     if engine.partitioner._assist is not None else None,
                     "host_numel": sum(g.master.numel() for g in engine.partitioner.groups)}
        engine.close()
    return out


@pytest.mark.gpu
def test_slots_that_do_not_fit_leave_the_step_to_the_cpu():
    """A GPU too full for the slots: one warning, nothing queued on the GPU, and the run is
    the CPU-only run bit for bit."""
    need_cuda(1)
    out, = run_ranks(_oom_body, 1, timeout=300)
    full, off = out["full"], out["off"]
    c = full["counts"]
    assert c["off"] and c["numel_gpu"] == 0 and c["numel_cpu"] == STEPS * full["host_numel"]
    assert len(full["warned"]) == 1 and "step_assist" in full["warned"][0]
    assert full["held_gpu"] == 0  # the slot buffers made before the failure are released
    assert full["losses"] == off["losses"]
    assert all(torch.equal(a, b) for a, b in zip(full["states"], off["states"], strict=True))


# ---- memory estimate (hand computation) ------------------------------------------------------

@pytest.mark.parametrize("stage, kernel, assist, per_elem", [
    (2, "compiled", None, 16 + 2),    # fp32 master, moments, gradient + the bf16 host gradient
    (3, "compiled", None, 16 + 2 + 2),  # + the bf16 copy bound for the host shard
    (2, "torch", None, 16),           # fp32 host gradients: copied straight into the fp32 slot
    (2, "auto", False, None),         # off: no slots
])
def test_estimate_counts_the_slots(monkeypatch, stage, kernel, assist, per_elem):
    from zeroio.estimate import estimate_memory
    from zeroio.shard import assist as assist_mod

    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    monkeypatch.setenv("ZEROIO_CPU_ADAM", kernel)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    if assist is not None:
        zero["tiering"] = {"step_assist": assist}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                       "zero_optimization": zero})
    for psi, n in ((1_364_000_000, 1), (1_364_000_000, 2), (1000, 1), (1000, 2)):
        est = estimate_memory(psi, gpus_per_node=n, config=cfg)  # no slot beyond the shard
        slots = [i for i in est.items if i.name.startswith("step assist")]
        if per_elem is None:  # off
            assert slots == []
            continue
        shard = min(assist_mod.SLOT_NUMEL, -(-psi // n))
        assert [(i.tier, i.bytes_per_gpu) for i in slots] == [
            ("gpu", assist_mod.SLOTS * shard * per_elem)]


def _no_overlap_body():
    import os

    import zeroio
    from zeroio.shard import assist

    os.environ["ZEROIO_STEP_CHUNK_NUMEL"] = "64"
    os.environ["ZEROIO_STEP_ASSIST"] = "1"
    os.environ["ZEROIO_CPU_ADAM"] = "compiled"
    assist.SLOT_NUMEL = 32
    cfg = _config(3, "bf16")
    cfg["zero_optimization"]["tiering"] = {"overlap_step": False}
    engine, *_ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    losses = r12._train(engine, STEPS, 1, engine.device)
    counts = engine.stats()["sources"].get("stage3.step_assist")
    engine.close()
    return {"losses": losses, "counts": counts}


@pytest.mark.gpu
def test_stage3_assist_takes_chunks_without_the_overlap():
    """Stage 3 with ``overlap_step: false``: ``step()`` waits for the worker, and the worker's
    chunks still go to the GPU (the wait used to hide the worker from the assist)."""
    need_cuda(1)
    (out,) = run_ranks(_no_overlap_body, 1, timeout=300)
    assert out["counts"]["numel_gpu"] > 0, out["counts"]
    ref_losses, _ = r12._reference(1, STEPS, 1)
    assert out["losses"] == pytest.approx(ref_losses, rel=3e-2)
