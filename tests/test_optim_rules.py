"""SGD, Adagrad, Lion and Lamb (``optimizer.type``) on every offload path against single-process
references, at 2 gloo ranks: torch.optim.SGD / torch.optim.Adagrad, and for Lion and Lamb the
hand-written per-parameter references below (DeepSpeed's FusedLion and FusedLamb formulas,
written from their kernels' math, not from zeroio's code).

Tolerance: as tests/test_stage12_equivalence.py argues for fp32 (the same math, sums in another
order): 1e-5 relative on losses, 2e-6 absolute on the masters after STEPS steps, a small
fraction of what the weights move (lr 1e-2: ~1e-2 per step for Lion). Lion takes the sign of
a momentum, so an element whose momentum sits within rounding of 0 could flip; the seeds here
keep none there (checked by the tight tolerance).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from zeroio.testing import run_ranks

STEPS, GAS, MICRO, CLIP = 4, 2, 2, 0.5

RULE_CASES = {
    "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1,
                                      "weight_decay": 0.01, "nesterov": False}},
    "sgd_nesterov": {"type": "sgd", "params": {"lr": 0.05, "momentum": 0.8, "nesterov": True,
                                               "weight_decay": 0.02}},
    "sgd_plain": {"type": "SGD", "params": {"lr": 0.1}},
    "adagrad": {"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.01,
                                              "initial_accumulator_value": 0.2, "eps": 1e-9}},
    "lion": {"type": "Lion", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "lamb": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "lamb_clamped": {"type": "LAMB", "params": {"lr": 1e-2, "max_coeff": 0.2, "min_coeff": 0.15,
                                                "bias_correction": False,
                                                "eps_inside_sqrt": True}},
}


class LionReference(torch.optim.Optimizer):
    """Lion, per parameter tensor (Chen et al. 2023; DeepSpeed's FusedLion)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(group["lr"] * torch.sign(c))
                m.copy_(b2 * m + (1 - b2) * p.grad)


class LambReference(torch.optim.Optimizer):
    """DeepSpeed FusedLamb per parameter tensor: trust ratio of the whole tensor."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 bias_correction=True, max_coeff=10.0, min_coeff=0.01, eps_inside_sqrt=False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_coeff=max_coeff,
                                      min_coeff=min_coeff, eps_inside_sqrt=eps_inside_sqrt))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                g = p.grad
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["v"] = b2 * st["v"] + (1 - b2) * g * g
                denom = (torch.sqrt(st["v"] + group["eps"]) if group["eps_inside_sqrt"]
                         else torch.sqrt(st["v"]) + group["eps"])
                u = st["m"] / denom + group["weight_decay"] * p
                w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
                coef = 1.0
                if w_norm > 0 and u_norm > 0:
                    coef = float(torch.clamp(w_norm / u_norm, group["min_coeff"],
                                             group["max_coeff"]))
                size = group["lr"]
                if group["bias_correction"]:
                    size *= math.sqrt(1 - b2 ** st["t"]) / (1 - b1 ** st["t"])
                p.sub_(size * coef * u)


def make_reference(case, params):
    cfg = RULE_CASES[case]
    kind, p = cfg["type"].lower(), dict(cfg["params"])
    if kind == "sgd":
        return torch.optim.SGD(params, **p)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, **p)
    if kind == "lion":
        return LionReference(params, **p)
    return LambReference(params, **p)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7),
                               torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batches(world, steps=STEPS):
    g = torch.Generator().manual_seed(1234)
    return [[[(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g))
              for _ in range(world)] for _ in range(GAS)] for _ in range(steps)]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _wide():
    return torch.nn.Sequential(torch.nn.Linear(6, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 3))


def reference_run(case, init, batches, make_opt=make_reference, model_fn=_mlp):
    model = model_fn()
    model.load_state_dict(init)
    opt = make_opt(case, model.parameters())
    losses = []
    for step in batches:
        total = 0.0
        for micro in step:
            batch = tuple(torch.cat(parts) for parts in zip(*micro, strict=True))
            loss = _loss(model, batch)
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_config(case, stage, offload, nvme_dir, **extra):
    off = {"device": offload}
    if offload in ("ratio", "ratio_nvme"):  # part of the state stepped on the device
        off = {"device": "nvme" if offload == "ratio_nvme" else "cpu", "ratio": 0.5}
        if offload == "ratio_nvme":
            off["nvme_path"] = nvme_dir
    tiering = {"overlap_step": True} if offload == "overlap" else {}
    if offload == "overlap":  # the host step overlapped with the next forward
        off = {"device": "cpu"}
    if offload == "nvme":
        off["nvme_path"] = nvme_dir
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 97,
                                 "sub_group_size": 150, "offload_optimizer": off,
                                 "tiering": tiering}}
    if case is not None:
        cfg["optimizer"] = RULE_CASES[case]
    cfg.update(extra)
    return cfg


def train(engine, batches, rank):
    import torch.distributed as dist

    losses = []
    for step in batches:
        total = torch.zeros(1, dtype=torch.float64, device=engine.device)
        for micro in step:
            loss = _loss(engine, tuple(t.to(engine.device) for t in micro[rank]))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dist.all_reduce(total)
        losses.append(total.item() / (GAS * dist.get_world_size()))
    return losses


def gather_masters(engine):
    import torch.distributed as dist

    flat = torch.zeros(engine.partitioner.index.total_numel, dtype=torch.float64,
                       device=engine.device)
    for g in engine.partitioner.groups:
        master = engine.optimizer.local_tensor(g.group_index, "fp32")
        for s in g.segments:
            flat[s.global_offset:s.global_offset + s.numel] = \
                master[s.local_offset:s.local_offset + s.numel].double().to(engine.device)
    if engine.partitioner.stage != 0:  # stage 0: every rank holds every master
        dist.all_reduce(flat)
    flat = flat.cpu()
    return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape).float()
            for e in engine.partitioner.index.entries}


def compare(losses, masters, ref_losses, ref_params):
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    diff = max((masters[n] - ref_params[n]).abs().max().item() for n in ref_params)
    return loss_rel, diff


def _cases():
    out = []
    for i, case in enumerate(RULE_CASES):
        for offload in ("none", "cpu", "nvme"):
            out += [(case, 1 + i % 2, offload), (case, 3, offload)]
        out += [(case, 2, "ratio"), (case, 3, "ratio")]
        if not case.startswith("lamb"):  # Lamb refuses the overlapped (chunked) step
            out += [(case, 1 + i % 2, "overlap"), (case, 3, "overlap")]
    # stage 0 (every rank holds everything: Lamb's norms are not summed over ranks), and the
    # stage-3 ratio whose host side is on NVMe (Lamb's norms add the device side, the host
    # side and the ranks)
    return out + [("lamb", 0, "none"), ("lamb_clamped", 0, "cpu"), ("lion", 0, "cpu"),
                  ("lion", 3, "ratio_nvme"), ("adagrad", 3, "ratio_nvme"),
                  ("lamb", 3, "ratio_nvme"), ("lamb_clamped", 3, "ratio_nvme")]


def _rules_body(tmpdir):
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _mlp().state_dict().items()}
    batches = _batches(dist.get_world_size())
    results = []
    for case, stage, offload in _cases():
        ref_losses, ref_params = reference_run(case, init, batches)
        model = _mlp()
        model.load_state_dict(init)
        nvme = os.path.join(tmpdir, f"{case}-{stage}-r{rank}")
        engine, _, _, _ = zeroio.initialize(model=model,
                                            config=engine_config(case, stage, offload, nvme))
        losses = train(engine, batches, rank)
        moved = max((ref_params[n] - init[n]).abs().max().item() for n in ref_params)
        results.append(((case, stage, offload), *compare(losses, gather_masters(engine),
                                                          ref_losses, ref_params), moved,
                        type(engine.optimizer).__name__))
        engine.close()
    return results


def _check_rules(results, param_tol):
    for rank_results in results:
        for case, loss_rel, diff, moved, opt in rank_results:
            assert moved > 1e-3, (case, moved)  # the weights did move
            assert loss_rel < 1e-5, (case, opt, loss_rel)
            assert diff < param_tol, (case, opt, diff)


@pytest.mark.slow
def test_rules_match_reference_on_every_path(tmp_path):
    _check_rules(run_ranks(_rules_body, 2, str(tmp_path), timeout=400), 2e-6)


@pytest.mark.gpu
def test_rules_match_reference_on_cuda(tmp_path):
    """The same cases on CUDA with NCCL (1 or 2 GPUs): state on the GPU without offload, the
    overlapped host step ("auto" on CUDA) with offload; masters allowed 1e-5, as the Adam NCCL
    equivalence test argues (GPU sums round differently from the CPU reference's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = min(2, torch.cuda.device_count())
    _check_rules(run_ranks(_rules_body, world, str(tmp_path), backend="nccl", timeout=500), 1e-5)


def _resume_body(tmpdir):
    """Train 2 steps, save, train 2 more; a fresh engine loads the save and trains the same 2:
    the masters equal the uninterrupted run's exactly. Then a checkpoint of one rule loads
    into another only as a CheckpointError (weights only still load)."""
    import torch.distributed as dist

    import zeroio
    from zeroio.errors import CheckpointError

    rank = dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _mlp().state_dict().items()}
    batches = _batches(dist.get_world_size())
    out = []
    for case, stage, offload in [("adagrad", 2, "cpu"), ("lion", 3, "nvme"), ("lamb", 1, "none"),
                                 ("sgd", 3, "ratio"), ("lamb_clamped", 3, "cpu"),
                                 ("lamb", 2, "nvme"), ("lamb_clamped", 3, "ratio"),
                                 ("lamb", 3, "ratio_nvme")]:
        nvme = os.path.join(tmpdir, f"{case}-r{rank}")
        cfg = engine_config(case, stage, offload, nvme)
        model = _mlp()
        model.load_state_dict(init)
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
        train(engine, batches[:2], rank)
        ckpt = os.path.join(tmpdir, f"ckpt-{case}")
        engine.save_checkpoint(ckpt, tag="t")
        train(engine, batches[2:], rank)
        whole = gather_masters(engine)
        kinds = engine.optimizer.state_kinds
        engine.close()
        engine, _, _, _ = zeroio.initialize(model=_mlp(), config=cfg)
        engine.load_checkpoint(ckpt, tag="t")
        train(engine, batches[2:], rank)
        resumed = gather_masters(engine)
        engine.close()
        diff = max((whole[n] - resumed[n]).abs().max().item() for n in whole)
        other = "sgd" if case != "sgd" else "adagrad"
        engine, _, _, _ = zeroio.initialize(model=_mlp(),
                                            config=engine_config(other, stage, "none", nvme))
        try:
            engine.load_checkpoint(ckpt, tag="t")
            refused = ""
        except CheckpointError as e:
            refused = str(e)
        engine.load_checkpoint(ckpt, tag="t", load_optimizer_states=False)
        engine.close()
        out.append((case, kinds, diff, refused))
    return out


@pytest.mark.slow
def test_rule_checkpoint_resume_equals_uninterrupted(tmp_path):
    expected_kinds = {"adagrad": ("sum",), "lion": ("exp_avg",), "sgd": ("momentum_buffer",),
                      "lamb": ("exp_avg", "exp_avg_sq"), "lamb_clamped": ("exp_avg", "exp_avg_sq")}
    for rank_results in run_ranks(_resume_body, 2, str(tmp_path), timeout=300):
        for case, kinds, diff, refused in rank_results:
            assert kinds == expected_kinds[case]
            assert diff == 0.0, (case, diff)
            assert "optimizer state" in refused and "load_optimizer_states=False" in refused, \
                (case, refused)


@pytest.mark.parametrize("block, key", [
    ({"type": "OneBitLamb", "params": {"lr": 1e-3}}, "optimizer.type"),
    ({"type": "Lamb", "params": {"max_coef": 1.0}}, "optimizer.params.max_coef"),
    ({"type": "SGD", "params": {"nesterov": "yes"}}, "optimizer.params.nesterov"),
    ({"type": "Adagrad", "params": {"maximize": True}}, "optimizer.params.maximize"),
    ({"type": "Lion", "params": {"betas": [0.9]}}, "optimizer.params.betas"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm"),
])
def test_bad_optimizer_blocks_name_the_key(block, key):
    import zeroio
    from zeroio.errors import ConfigError

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": block}
    with pytest.raises(ConfigError) as e:
        zeroio.initialize(model=_mlp(), config=cfg)
    assert e.value.key == key, e.value


@pytest.mark.parametrize("case, zero, key", [
    ("lion", {"offload_optimizer": {"device": "cpu"}, "tiering": {"step_assist": True}},
     "zero_optimization.tiering.step_assist"),
    ("lamb", {"offload_optimizer": {"device": "cpu"}, "tiering": {"overlap_step": True}},
     "zero_optimization.tiering.overlap_step"),
])
def test_unsupported_paths_are_config_errors(case, zero, key):
    import zeroio
    from zeroio.errors import ConfigError

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": RULE_CASES[case],
           "zero_optimization": {"stage": 2, **zero}}
    with pytest.raises(ConfigError) as e:
        zeroio.initialize(model=_mlp(), config=cfg)
    assert e.value.key == key, e.value


CLIENTS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, alpha=0.9, momentum=0.5),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.01),
}


def _client_body(tmpdir):
    """Client torch.optim optimizers (offload cpu with zero_force_ds_cpu_optimizer false, and
    no offload) equal the same class on the plain model; a save/load resume equals the
    uninterrupted run."""
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _mlp().state_dict().items()}
    batches = _batches(dist.get_world_size())
    out = []
    for name, stage, offload in [("sgd", 2, "cpu"), ("rmsprop", 3, "cpu"), ("adam", 1, "cpu"),
                                 ("sgd", 3, "none"), ("rmsprop", 2, "none")]:
        ref_losses, ref_params = reference_run(name, init, batches,
                                               make_opt=lambda c, p: CLIENTS[c](p))
        cfg = engine_config(None, stage, offload, None, zero_force_ds_cpu_optimizer=False)

        def fresh(cfg=cfg, name=name):
            model = _mlp()
            model.load_state_dict(init)
            return zeroio.initialize(model=model, config=cfg,
                                     optimizer=CLIENTS[name](model.parameters()))[0]

        engine = fresh()
        losses = train(engine, batches[:2], rank)
        ckpt = os.path.join(tmpdir, f"client-{name}-{stage}")
        engine.save_checkpoint(ckpt, tag="t")
        losses += train(engine, batches[2:], rank)
        masters = gather_masters(engine)
        opt = type(engine.optimizer).__name__
        engine.close()
        engine = fresh()
        engine.load_checkpoint(ckpt, tag="t")
        train(engine, batches[2:], rank)
        resumed = gather_masters(engine)
        engine.close()
        resume_diff = max((masters[n] - resumed[n]).abs().max().item() for n in masters)
        out.append(((name, stage, offload), opt, *compare(losses, masters, ref_losses,
                                                          ref_params), resume_diff))
    return out


@pytest.mark.slow
def test_client_optimizer_steps_the_shards(tmp_path):
    for rank_results in run_ranks(_client_body, 2, str(tmp_path), timeout=300):
        for case, opt, loss_rel, diff, resume_diff in rank_results:
            # torch's Adam/AdamW are zeroio's Adam (the same update); any other class steps itself
            assert opt == ("ShardedAdam" if case[0] == "adam" else "ClientOnShards"), (case, opt)
            assert loss_rel < 1e-5, (case, loss_rel)
            assert diff < 2e-6, (case, diff)
            assert resume_diff == 0.0, (case, resume_diff)


def test_client_optimizer_with_offload_needs_the_flag_off():
    import zeroio
    from zeroio.errors import ConfigError

    model = _mlp()
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as e:
        zeroio.initialize(model=model, config=cfg,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert e.value.key == "zero_force_ds_cpu_optimizer"
    cfg["zero_force_ds_cpu_optimizer"] = False
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(ConfigError) as e:
        zeroio.initialize(model=model, config=cfg,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert e.value.key == "zero_optimization.offload_optimizer.device"


def _streamed_body(tmpdir):
    """NVMe state through a host budget of a few pieces: pieces are read back from the disk
    every step (not all resident), and the numbers stay the reference's. Lamb reads its
    streamed pieces twice a step ([Note: two passes over swapped Lamb moments])."""
    import torch.distributed as dist

    import zeroio

    rank = dist.get_rank()
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _wide().state_dict().items()}
    batches = _batches(dist.get_world_size())
    out = []
    for case, stage in [("lion", 2), ("adagrad", 3), ("sgd_nesterov", 1), ("lamb", 2),
                        ("lamb_clamped", 3)]:
        ref_losses, ref_params = reference_run(case, init, batches, model_fn=_wide)
        model = _wide()
        model.load_state_dict(init)
        cfg = engine_config(case, stage, "nvme", os.path.join(tmpdir, f"{case}-r{rank}"))
        # ~9k elements per rank in pieces of 1024; the host budget (all host state, ~210 KB
        # of it masters, gradients and buffers) leaves the optimizer a few pieces' state
        cfg["zero_optimization"].update(sub_group_size=1024,
                                        tiering={"cpu_budget_bytes": 236 << 10})
        engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
        losses = train(engine, batches, rank)
        moved = engine.stats()["bytes_moved"]
        read, written = moved.get("nvme->cpu", 0), moved.get("cpu->nvme", 0)
        out.append((case, *compare(losses, gather_masters(engine), ref_losses, ref_params),
                    read, written, type(engine.optimizer).__name__))
        engine.close()
    return out


@pytest.mark.slow
def test_rules_stream_nvme_state_through_a_small_host_budget(tmp_path):
    for rank_results in run_ranks(_streamed_body, 2, str(tmp_path), timeout=300):
        for case, loss_rel, diff, read, written, opt in rank_results:
            lamb = case.startswith("lamb")
            assert opt == ("SwappedLamb" if lamb else "SwappedRule"), (case, opt)
            assert read > 0, (case, read)
            if lamb:  # two reads of a streamed piece per step, one write
                assert read > 1.5 * written, (case, read, written)
            assert loss_rel < 1e-5 and diff < 2e-6, (case, loss_rel, diff)


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_one_tensor_equals_the_reference(case):
    """The rule on one flat tensor (no engine): SGD and Adagrad bit for bit torch.optim's
    single-tensor CPU path; Lion and Lamb (one tensor = one parameter) the references above."""
    from zeroio.optim.rules import RULES, LambRule

    cfg = load_config_params(case)
    rule = RULES[RULE_CASES[case]["type"].lower()]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(257, generator=g)
    ref = w.clone().requires_grad_(True)
    opt = make_reference(case, [ref])
    state = {k: torch.full_like(w, rule.initial(k, cfg)) for k in rule.kinds_for([cfg])}
    for step in range(1, 6):
        grad = torch.randn(257, generator=g)
        ref.grad = grad.clone()
        opt.step()
        if rule.elementwise:
            rule.update(master=w, grad=grad.clone(), state=state, hyper=cfg, step=step)
        else:
            u = LambRule.moments(master=w, grad=grad.clone(), state=state, hyper=cfg)
            coef = LambRule.coefficient(w.norm().item(), u.norm().item(), cfg)
            w.add_(u, alpha=-LambRule.step_size(cfg, step) * coef)
    if case.startswith(("sgd", "adagrad")):
        assert torch.equal(w, ref.detach())
    else:
        torch.testing.assert_close(w, ref.detach(), rtol=0, atol=1e-6)
    assert (w - ref.detach()).abs().max() < 1e-6 and (ref.detach() != 0).any()


def load_config_params(case):
    """The case's params as the config layer completes them (defaults filled)."""
    from zeroio.config import load_config

    block = load_config({"train_micro_batch_size_per_gpu": 1,
                         "optimizer": RULE_CASES[case]}).optimizer
    p = dict(block.params)
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    return p
