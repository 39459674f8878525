"""The one-pass CPU Adam(W) kernel (zeroio/optim/cpu_adam.py, compiled by torch inductor).

Checked against torch.optim.AdamW / Adam (single tensor, no fused kernel) step by step, on
chunks at odd offsets and lengths; its 16-bit output against the master's own cast; the
gradient's bytes against a copy (the kernel never writes it); and, in training, stage 2 and
stage 3 with offload_optimizer cpu forced onto the kernel against plain AdamW + clipping."""


import pytest
import torch

from zeroio.errors import ConfigError
from zeroio.optim import cpu_adam
from zeroio.testing import run_ranks
from zeroio.testing.markers import needs_compiler
from zeroio.testing.models import mlp_batch, mlp_reference, tiny_mlp


def _torch_steps(init, grads, *, decoupled, wd, lr, scales):
    p = torch.nn.Parameter(init.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=False)
    out = []
    for g, s in zip(grads, scales, strict=True):
        p.grad = g / s
        opt.step()
        st = opt.state[p]
        out.append((p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()))
    return out


@needs_compiler
@pytest.mark.parametrize("decoupled", [True, False])
def test_matches_torch_adam_chunk_by_chunk(monkeypatch, decoupled):
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    assert cpu_adam.wanted(1)
    n, lr, wd = 1000, 1e-2, 0.1
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 3 for _ in range(3)]
    scales = [1.0, 2.5, 0.75]
    ref = _torch_steps(init, grads, decoupled=decoupled, wd=wd, lr=lr, scales=scales)
    master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    spans = [(0, 1), (1, 130), (131, 7), (138, 862)]  # odd offsets and lengths
    for step, (g, s) in enumerate(zip(grads, scales, strict=True), start=1):
        h = cpu_adam.hyper_tensor(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd,
                                  decoupled=decoupled, step=step, grad_scale=s)
        g_before = g.clone()
        out16 = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        for lo, k in spans:
            cpu_adam.step_chunk(master=master.narrow(0, lo, k), grad=g.narrow(0, lo, k),
                                exp_avg=m.narrow(0, lo, k), exp_avg_sq=v.narrow(0, lo, k),
                                hyper=h, out=out16.narrow(0, lo, k))
        assert torch.equal(g, g_before), "the kernel wrote the gradient"
        rp, rm, rv = ref[step - 1]
        torch.testing.assert_close(master, rp, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, rm, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, rv, rtol=1e-6, atol=1e-7)
        assert torch.equal(out16, master.to(torch.bfloat16))


@needs_compiler
def test_without_out_and_with_fp32_out(monkeypatch):
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    gen = torch.Generator().manual_seed(1)
    n = 257
    a, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    b = a.clone()
    m1, v1, m2, v2 = (torch.zeros(n) for _ in range(4))
    h = cpu_adam.hyper_tensor(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                              decoupled=True, step=1, grad_scale=1.0)
    out = torch.empty(n)
    cpu_adam.step_chunk(master=a, grad=g, exp_avg=m1, exp_avg_sq=v1, hyper=h)
    cpu_adam.step_chunk(master=b, grad=g, exp_avg=m2, exp_avg_sq=v2, hyper=h, out=out)
    assert torch.equal(a, b) and torch.equal(out, b) and torch.equal(m1, m2)
    assert not torch.equal(a, torch.zeros(n))


def test_mode_names_the_variable_on_bad_input(monkeypatch):
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "fastest")
    with pytest.raises(ConfigError, match="ZEROIO_CPU_ADAM='fastest'.*auto, compiled, torch"):
        cpu_adam.mode()
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "torch")
    assert not cpu_adam.wanted(1 << 30)
    monkeypatch.delenv("ZEROIO_CPU_ADAM")
    assert cpu_adam.mode() == "auto"  # the default (measured in benchmarks/train_peers.py on H200 hosts)
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "auto")
    assert not cpu_adam.wanted(cpu_adam.AUTO_MIN_NUMEL - 1)  # small: no compile


STEPS, LR, CLIP = 4, 1e-2, 0.5


def _train(stage, overlap):
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    zero = {"stage": stage, "reduce_bucket_size": 40, "offload_optimizer": {"device": "cpu"},
            "tiering": {"overlap_step": overlap}}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, sub_group_size=100,
                    stage3_param_persistence_threshold=0)
    cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP, "bf16": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
           "zero_optimization": zero}
    engine, _, _, _ = zeroio.initialize(model=tiny_mlp(), config=cfg)
    host_opt = getattr(engine.optimizer, "host", engine.optimizer)
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.synchronize()
    if stage == 3:
        with zeroio.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().reshape(-1).tolist() for p in engine.module.parameters()]
    else:
        params = [p.detach().reshape(-1).tolist() for p in engine.module.parameters()]
    engine.close()
    return losses, params, bool(host_opt.one_pass)


@needs_compiler
@pytest.mark.parametrize("world,stage,overlap", [(1, 2, True), (2, 2, False), (2, 3, True)])
def test_training_on_the_kernel_matches_torch_adamw(world, stage, overlap):
    results = run_ranks(_train, world, stage, overlap, env={"ZEROIO_CPU_ADAM": "compiled"})
    ref_losses, ref_params = mlp_reference(world, STEPS, lr=LR, clip=CLIP)
    for rank, (losses, params, one_pass) in enumerate(results):
        assert one_pass, "the host optimizer did not use the one-pass kernel"
        for step in range(STEPS):
            assert losses[step] == pytest.approx(ref_losses[step][rank], rel=1e-5, abs=1e-6)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(torch.tensor(p), q.reshape(-1), rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_out", [False, True])
def test_16bit_gradient_equals_its_fp32_upcast(monkeypatch, grad_dtype, with_out):
    """A 16-bit gradient (stage 1/2's 16-bit host gradients) gives bit for bit the step on
    ``grad.float()``, with a grad_scale that is not 1 (where 1/world is folded in)."""
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    assert cpu_adam.wanted(1, grad_dtype=grad_dtype)
    gen = torch.Generator().manual_seed(2)
    n = 1031
    init = torch.randn(n, generator=gen)
    g16 = (torch.randn(n, generator=gen) * 5).to(grad_dtype)
    g16_before = g16.clone()
    runs = []
    for g in (g16, g16.float()):
        master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=grad_dtype) if with_out else None
        for step in (1, 2):
            h = cpu_adam.hyper_tensor(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                      decoupled=True, step=step, grad_scale=3.0)
            for lo, k in ((0, 3), (3, 600), (603, 428)):
                cpu_adam.step_chunk(master=master.narrow(0, lo, k), grad=g.narrow(0, lo, k),
                                    exp_avg=m.narrow(0, lo, k), exp_avg_sq=v.narrow(0, lo, k),
                                    hyper=h, out=None if out is None else out.narrow(0, lo, k))
        runs.append((master, m, v, out))
    (p1, m1, v1, o1), (p2, m2, v2, o2) = runs
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)
    assert not torch.equal(p1, init)
    if with_out:
        assert torch.equal(o1, o2) and torch.equal(o1, p1.to(grad_dtype))
    assert torch.equal(g16, g16_before), "the kernel wrote the gradient"


@needs_compiler
def test_sharded_adam_folds_grad_divisor(monkeypatch):
    """``grad_divisor`` (the 1/world of 16-bit host gradients) is folded into grad_scale: a
    bf16 gradient ``g`` with divisor 2 steps as the fp32 gradient ``g / 2`` (eps 0.1, so the
    update depends on the gradient's size), chunked and whole."""
    from zeroio.optim.adam import ShardedAdam
    from zeroio.partition.base import Segment, ShardGroup

    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    gen = torch.Generator().manual_seed(3)
    n = 301
    init = torch.randn(n, generator=gen)
    g16 = (torch.randn(n, generator=gen) * 0.3).to(torch.bfloat16)
    results = []
    for grad, divisor in ((g16, 2.0), (g16.float() / 2, 1.0)):
        group = ShardGroup(group_index=0, master=init.clone(), grad=grad.clone(), numel=n,
                           segments=(Segment(local_offset=0, global_offset=0, numel=n),),
                           params=("w",))
        opt = ShardedAdam([group], [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 0.1,
                                     "weight_decay": 0.0}], decoupled=True,
                          grad_divisor=divisor)
        assert opt.one_pass
        opt.step(grad_scale=1.5)
        chunked = opt.begin_chunked_step(grad_scale=1.5)
        for lo, k in ((0, 100), (100, 201)):
            chunked.update(0, lo, k)
        results.append(group.master)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], init)


_PROBE_SCRIPT = """
import torch
from torch._inductor import cpu_vec_isa
calls = []
real = cpu_vec_isa.VecISA.check_build
def spy(self, code):
    calls.append(str(self))
    return real(self, code)
cpu_vec_isa.VecISA.check_build = spy
torch.cpu._is_avx512_bf16_supported = lambda: True  # as on the H200 host: its probe runs
from zeroio.optim import cpu_adam
assert cpu_adam.wanted(1, torch.bfloat16)
n = 1000
p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
out = torch.empty(n, dtype=torch.bfloat16)
h = cpu_adam.hyper_tensor(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                          decoupled=True, step=1, grad_scale=1.0)
cpu_adam.step_chunk(master=p, grad=torch.ones(n, dtype=torch.bfloat16), exp_avg=m,
                    exp_avg_sq=v, hyper=h, out=out)
print("probes", len(calls), "value", round(float(p[0]), 4))
"""


@needs_compiler
def test_compile_runs_no_isa_probe_builds(tmp_path):
    """inductor's avx512_bf16 / AMX probes (a g++ build + a child Python importing torch, per
    process) are skipped while the kernel compiles and loads: they took > 45 s per process on
    the H200 host. A fresh inductor cache, so the kernel's own build runs too."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ZEROIO_CPU_ADAM="compiled", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    done = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    # Adam's first step moves every weight by lr (m / sqrt(v) = 1 after bias correction)
    assert line == "probes 0 value 0.9", line


# ---- the variants a step calls are built before it --------------------------------------------

# (stage, offload_param, compute dtype, gradient_accumulation_steps) -> the one variant (gradient
# dtype, output dtype) the host step calls (partitioners' run_step; CPU device)
VARIANT_CASES = [
    ((3, "none", "bf16", 1), ("torch.bfloat16", None)),   # parameters on the device: no output
    ((3, "nvme", "bf16", 1), ("torch.bfloat16", None)),   # parameters on NVMe: no output
    ((3, "cpu", "bf16", 1), ("torch.bfloat16", "torch.bfloat16")),  # writes the host shard
    ((2, "none", "bf16", 1), ("torch.bfloat16", "torch.bfloat16")),  # writes the parameters
    ((2, "none", "bf16", 2), ("torch.float32", "torch.bfloat16")),   # stage 2 accumulates: fp32
    ((1, "none", "fp32", 1), ("torch.float32", "torch.float32")),    # fp32: the parameters
]                                                # (on CUDA: none, the master goes up as it is)


def _first_steps_compile(tmpdir, cases):
    """Per case, in this (fresh) process with no variant built: the kernel variants compiled by
    ``initialize``, those compiled during two training steps, and those the steps called."""
    from unittest import mock

    import zeroio

    results = []
    for (stage, param, dtype, gas), _ in cases:
        compiled, called = [], set()
        real_compile, real_step = cpu_adam._Kernels._compile, cpu_adam.step_chunk

        def compile_spy(out_dtype, grad_dtype, compiled=compiled, real=real_compile):
            compiled.append((str(grad_dtype), None if out_dtype is None else str(out_dtype)))
            return real(out_dtype, grad_dtype)

        def step_spy(*, grad, out=None, called=called, real=real_step, **kw):
            called.add((str(grad.dtype), None if out is None else str(out.dtype)))
            return real(grad=grad, out=out, **kw)

        zero = {"stage": stage, "reduce_bucket_size": 40, "offload_optimizer": {"device": "cpu"}}
        if stage == 3:
            zero.update(sub_group_size=100, stage3_param_persistence_threshold=0,
                        offload_param={"device": param, "nvme_path": f"{tmpdir}/{len(results)}"}
                        if param == "nvme" else {"device": param})
        cfg = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": gas,
               "bf16": {"enabled": dtype == "bf16"},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
        with mock.patch.object(cpu_adam, "_KERNELS", cpu_adam._Kernels()), \
                mock.patch.object(cpu_adam._Kernels, "_compile", staticmethod(compile_spy)), \
                mock.patch.object(cpu_adam, "step_chunk", step_spy):
            engine, _, _, _ = zeroio.initialize(model=tiny_mlp(), config=cfg)
            at_init = list(compiled)
            for step in range(2 * gas):
                x, y = mlp_batch(step, 0)
                x = x.to(engine.device, torch.bfloat16 if dtype == "bf16" else torch.float32)
                loss = torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device))
                engine.backward(loss)
                engine.step()
            engine.synchronize()
            host_grads = sorted({str(g.grad.dtype) for g in getattr(
                engine.optimizer, "host", engine.optimizer).groups if g.grad.numel()})
            engine.close()
        results.append(dict(cuda=engine.device.type == "cuda", at_init=at_init,
                            in_steps=compiled[len(at_init):],
                            called=sorted(called, key=str), host_grads=host_grads))
    return results


@needs_compiler
def test_no_compile_during_the_first_steps(tmp_path):
    """``initialize`` builds exactly the kernel variant the host step calls (the partitioners
    pass ``step_out`` to ``cpu_adam.wanted`` through host_grads.py), so no training step
    compiles; with parameters on the device or NVMe at stage 3 that is the 16-bit gradient
    without output, which the first step used to compile."""
    results = run_ranks(_first_steps_compile, 1, str(tmp_path), VARIANT_CASES, timeout=900,
                        env={"ZEROIO_CPU_ADAM": "compiled"})[0]
    for (case, variant), r in zip(VARIANT_CASES, results, strict=True):
        if r["cuda"] and case[2] == "fp32":
            variant = (variant[0], None)
        assert r["called"] == [variant], (case, r)
        assert r["host_grads"] == [variant[0]], (case, r)
        assert r["in_steps"] == [], (case, r)
        assert r["at_init"] == [variant], (case, r)
