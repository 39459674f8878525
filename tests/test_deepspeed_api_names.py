"""DeepSpeed's commonly used API names answer with zeroio's semantics.

One run of tests/scripts/ds_api_names.py (a plain DeepSpeed-style script: ``deepspeed.comm``,
``DeepSpeedConfig``, ``deepspeed.checkpointing``, the ``safe_get_full_*`` /
``safe_set_full_fp32_param`` accessors, ``zero_to_fp32``, the ZeRO-2/3 estimators,
``see_memory_usage``, ``log_dist``, ``DeepSpeedOptimizer``, ``FusedLamb``,
``DeepSpeedCPULion``) under ``zeroio launch`` on 2 gloo ranks at ZeRO stage 3 (and, on a GPU
machine, on one GPU with optimizer and parameters offloaded), held to
independent references: plain PyTorch on the full batch (losses, every step's gradients,
the weights and torch AdamW's moments), the safetensors file read back by ``safetensors``,
Lamb and Lion written out here from DeepSpeed's formulas, the collectives' and the
estimators' values computed by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroio.testing.cuda import need_cuda
from zeroio.testing.multirank import free_port, outside_launcher_env, path_first

SCRIPT = Path(__file__).parent / "scripts" / "ds_api_names.py"
REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH, LR = 3, 8, 0.01
pytestmark = pytest.mark.slow


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(6, 16), torch.nn.Linear(16, 2)


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(BATCH, 6, generator=g)
        s = x.sum(dim=1, keepdim=True)
        yield x, torch.cat([s.sin(), s.cos()], dim=1)


def _forward(fc1, fc2, x):
    return fc2(torch.tanh(fc1(x)))


def _named(fc1, fc2):
    return {"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "fc2.weight": fc2.weight,
            "fc2.bias": fc2.bias}


def _flat(t) -> list[float]:
    return t.detach().double().reshape(-1).tolist()


def _adamw_reference():
    """Plain PyTorch AdamW on the full batch: losses, gradients per step, weights, moments."""
    fc1, fc2 = _net()
    named = _named(fc1, fc2)
    opt = torch.optim.AdamW(list(named.values()), lr=LR, weight_decay=0.0)
    losses, grads = [], []
    for x, y in _batches(STEPS):
        loss = torch.nn.functional.mse_loss(_forward(fc1, fc2, x), y)
        opt.zero_grad()
        loss.backward()
        grads.append({n: _flat(p.grad) for n, p in named.items()})
        opt.step()
        losses.append(loss.item())
    state = {n: opt.state[p] for n, p in named.items()}
    return {"losses": losses, "grads": grads, "fp32": {n: _flat(p) for n, p in named.items()},
            "exp_avg": {n: _flat(s["exp_avg"]) for n, s in state.items()},
            "exp_avg_sq": {n: _flat(s["exp_avg_sq"]) for n, s in state.items()},
            "modules": (fc1, fc2)}


def _rule_reference(update, steps=2):
    """Losses and weights of a per-parameter rule ``update(p, grad, state, step)`` (full batch,
    lr 0.01, weight decay 0.1, DeepSpeed's default betas)."""
    fc1, fc2 = _net()
    named = _named(fc1, fc2)
    states = {n: {} for n in named}
    losses = []
    for t, (x, y) in enumerate(_batches(steps), start=1):
        loss = torch.nn.functional.mse_loss(_forward(fc1, fc2, x), y)
        for p in named.values():
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for n, p in named.items():
                update(p, p.grad, states[n], t)
        losses.append(loss.item())
    return losses, {n: _flat(p) for n, p in named.items()}


def _lamb(p, g, st, t, lr=LR, wd=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """DeepSpeed's FusedLamb: Adam moments, u = m/(sqrt(v)+eps) + wd w, per-parameter trust
    ratio ||w||/||u|| clamped to [0.01, 10], bias-corrected step size."""
    m = st.setdefault("m", torch.zeros_like(p))
    v = st.setdefault("v", torch.zeros_like(p))
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    u = m / (v.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm().item(), u.norm().item()
    ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, 0.01), 10.0)
    p.sub_(lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * ratio * u)


def _lion(p, g, st, t, lr=LR, wd=0.1, b1=0.9, b2=0.999):
    """Lion (DeepSpeed's CPU/fused Lion): decoupled decay, sign step, then the momentum."""
    m = st.setdefault("m", torch.zeros_like(p))
    p.mul_(1 - lr * wd)
    p.sub_(lr * (b1 * m + (1 - b1) * g).sign())
    m.mul_(b2).add_(g, alpha=1 - b2)


_ZERO = {
    # 2 gloo ranks, everything on the compute device
    "cpu": {"stage": 3},
    # one GPU with the optimizer and parameters offloaded: the step assist's resident chunks,
    # stage 3's resident gradients and pinned host shards are where the accessors read
    "gpu": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


@pytest.fixture(scope="module", params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def run(request, tmp_path_factory):
    world = 2 if request.param == "cpu" else 1
    if request.param == "gpu":
        need_cuda(1)
    tmp = tmp_path_factory.mktemp(f"ds_api_names_{request.param}")
    cfg = tmp / "ds.json"
    cfg.write_text(json.dumps({
        "train_batch_size": BATCH, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": _ZERO[request.param],
        "activation_checkpointing": {"cpu_checkpointing": True}}))
    cmd = [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", str(world),
           "--master_port", str(free_port()), str(SCRIPT), "--deepspeed", "--deepspeed_config",
           str(cfg), "--save_dir", str(tmp / "ckpt"), "--steps", str(STEPS)]
    proc = subprocess.run(cmd, cwd=tmp, env=outside_launcher_env(PYTHONPATH=path_first(str(REPO))),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(ln.split("RESULT ", 1)[1]) for ln in proc.stdout.splitlines()
            if "RESULT " in ln]
    return {"rows": sorted(rows, key=lambda r: r["rank"]), "stdout": proc.stdout, "tmp": tmp,
            "world": world, "offload": request.param == "gpu"}


def _close(a, b, tol=1e-5):
    for name in b:
        assert a[name] == pytest.approx(b[name], rel=tol, abs=tol), name


def test_comm_collectives_and_getters(run):
    w = run["world"]
    for r in run["rows"]:
        rank = r["rank"]
        assert r["world"] == w and r["local_rank"] == rank
        c = r["comm"]
        assert c["all_reduce"] == w * (w + 1) / 2  # ranks contribute 1, 2, ..., w
        assert c["all_gather_into_tensor"] == [v for q in range(w) for v in (q, 10.0 * q)]
        # rank q's input is arange(2w) + q: the sum is w * arange(2w) + w(w-1)/2, split by rank
        total = [w * i + w * (w - 1) / 2 for i in range(2 * w)]
        assert c["reduce_scatter_tensor"] == total[2 * rank:2 * rank + 2]
        assert c["broadcast"] == (w - 1) * 7 + 3
        assert c["all_gather"] == [2.0 * q for q in range(w)]
        assert c["avg"] == (w - 1) / 2
        assert c["ranks"] == list(range(w))


def test_deepspeed_config_reads_the_batch_for_this_world(run):
    for r in run["rows"]:
        assert r["config"] == {"micro": BATCH // run["world"], "gas": 1, "stage": 3,
                               "optimizer": "adamw",
                               "same_class": True}
        assert r["optimizer_is_ds"] is True


def test_training_with_checkpointed_block_equals_pytorch(run):
    ref = _adamw_reference()
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in run["rows"]) / run["world"]
        assert mean == pytest.approx(ref["losses"][step], rel=1e-5)


def test_full_grad_master_and_moments_equal_pytorch(run):
    ref = _adamw_reference()
    for r in run["rows"]:  # every rank gets the whole tensors
        for step in range(STEPS):
            _close(r["grads"][step], ref["grads"][step])
        _close(r["fp32"], ref["fp32"])
        _close(r["exp_avg"], ref["exp_avg"])
        _close(r["exp_avg_sq"], ref["exp_avg_sq"], tol=1e-7)


def test_zero_to_fp32_reads_the_checkpoint(run):
    from safetensors.torch import load_file

    rows = run["rows"]
    for r in rows:
        assert r["consolidated"] == r["fp32"]  # the saved masters, bit for bit
    assert rows[0]["loaded"] == rows[0]["fp32"]
    written = load_file(run["tmp"] / "ckpt-fp32" / "model.safetensors")
    assert {n: _flat(t) for n, t in written.items()} == rows[0]["fp32"]
    assert all(t.dtype == torch.float32 for t in written.values())


def test_set_full_fp32_param_reaches_the_next_forward(run):
    ref = _adamw_reference()
    fc1, fc2 = ref["modules"]
    with torch.no_grad():
        fc2.bias.copy_(torch.tensor([0.25, -0.5]))
    x = list(_batches(STEPS + 1))[-1][0]
    for r in run["rows"]:
        assert r["set_bias"] == [0.25, -0.5]
        per = BATCH // run["world"]
        mine = x[r["rank"] * per:(r["rank"] + 1) * per]
        assert r["after_set"] == pytest.approx(_flat(_forward(fc1, fc2, mine)), rel=1e-5,
                                               abs=1e-6)


def test_estimators_count_zeroio_model_states(run):
    psi, largest, n, b, k = 6 * 16 + 16 + 16 * 2 + 2, 6 * 16 + 16, run["world"], 2, 12
    live = 2 * b * largest  # the largest layer gathered: 16-bit values and gradient
    whole = 4 * psi * n     # without zero.Init: each rank's fp32 model on the node

    def z3(param, opt, zero_init):
        # ZeRO-3: b + b + k bytes per parameter, 1/n of them per rank; offload_param moves the
        # 16-bit parameters (b), offload_optimizer the gradients and Adam state (b + k)
        on_cpu = (b if param == "cpu" else 0) + ((b + k) if opt == "cpu" else 0)
        cpu = on_cpu * psi  # per node: n ranks' shares
        gpu = (2 * b + k - on_cpu) * psi // n + live
        return {"offload_param": param, "offload_optimizer": opt, "zero_init": zero_init,
                "cpu_bytes": int((cpu if zero_init else max(cpu, whole)) * 1.5),
                "gpu_bytes": gpu}

    expect3 = [z3(p, o, zi) for p, o in (("cpu", "cpu"), ("none", "cpu"), ("none", "none"))
               for zi in (True, False)]
    expect2 = [{"offload_optimizer": "cpu", "cpu_bytes": int((b + k) * psi * 1.5),
                "gpu_bytes": b * psi},
               {"offload_optimizer": "none", "cpu_bytes": 0,
                "gpu_bytes": b * psi + (b + k) * psi // n}]
    for r in run["rows"]:
        assert r["estimate3"] == expect3
        assert r["estimate2"] == expect2
    assert "per CPU  |  per GPU |   Options" in run["stdout"]


def test_fused_lamb_and_cpu_lion_step_as_deepspeeds_rules(run):
    for name, rule in (("lamb", _lamb), ("lion", _lion)):
        losses, params = _rule_reference(rule)
        for r in run["rows"]:
            _close(r[name]["params"], params)
        for step in range(2):
            got = sum(r[name]["losses"][step] for r in run["rows"]) / run["world"]
            assert got == pytest.approx(losses[step], rel=1e-5), (name, step)


def test_log_dist_see_memory_usage_and_banner_on_rank_0_only(run):
    out = run["stdout"]
    banners = [ln for ln in out.splitlines() if ln.startswith("[zeroio] zeroio ")]
    assert len(banners) == 3  # one per engine (AdamW at stage 3, Lamb, Lion), rank 0 only
    offload = "cpu, params cpu" if run["offload"] else "none, params none"
    assert f" | ZeRO stage 3, {run['world']} rank(s), fp32 | offload optimizer {offload} | " \
        in banners[0]
    assert f" | ZeRO stage 2, {run['world']} rank(s), fp32 | offload optimizer cpu, params none" \
        in banners[2]
    assert out.count("[Rank 0] log_dist says hello") == 1
    assert "[Rank 1] log_dist" not in out
    assert out.count("see_memory_usage after training") == 1
    assert out.count("CPU Virtual Memory:") == 1


def test_names_zeroio_does_not_serve_say_what_it_offers(run):
    errors = run["rows"][0]["errors"]
    assert errors["pipe"].startswith("deepspeed.pipe: pipeline parallelism is not served")
    assert "zeroio is ZeRO data parallelism" in errors["pipe"]
    assert errors["init_inference"].startswith("deepspeed.init_inference: DeepSpeed inference "
                                                "is not served")
