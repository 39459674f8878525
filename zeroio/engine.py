"""``zeroio.initialize`` and the ``Engine``: config -> partitioner -> optimizer -> schedule.

The engine owns the step protocol (partition/base.py ``Partitioner``):
``backward`` scales the loss and lets the partitioner's hooks reduce
gradients; ``step`` — only at the accumulation boundary — checks overflow and
the global norm with one all-reduce, steps the optimizer over the
partitioner's ``ShardGroup``s, steps the LR schedule and publishes the
updated parameters. Which partitioner and optimizer run is decided in one place,
engine_build.py (``build_partitioner``, ``build_optimizer``); how the update is applied and
published, once at initialize too (step_protocol.py, [Note: step protocols]).

[Note: one all-reduce for norm and overflow]
Each rank's squared gradient norm is summed over ranks (``local_grad_sq_norm``
is defined so the sum is the global value). An inf/nan on any rank makes the
sum non-finite on every rank, so the same scalar decides clipping and — with
fp16 — skipping the step, identically everywhere, without a second collective.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from zeroio import preemption, shutdown
from zeroio.config import load_config
from zeroio.config.launch_env import launch_env
from zeroio.config.loader import collective_timeout
from zeroio.engine_build import (
    build_optimizer,
    build_partitioner,
    engine_placement,
    explicit_budgets,
    fit_budgets,
    placed_policies,
    resolve_engine_policies,
    swap_cleanup,
)
from zeroio.engine_state import MicroStep, Phase
from zeroio.errors import CheckpointError, ConfigError, NonFiniteGradientError, StepFailedError
from zeroio.optim.factory import from_client, from_config, require_trainable
from zeroio.optim.loss_scaler import build_loss_scaler
from zeroio.optim.lr_schedules import build_scheduler
from zeroio.optim.rule_build import rule_policies
from zeroio.partition import collectives as comm
from zeroio.preflight import check_host_memory
from zeroio.step_guard import StepGuard
from zeroio.step_protocol import choose_protocol
from zeroio.tiering import stats as tstats
from zeroio.tiering.breakdown import StepTimeline, format_breakdown
from zeroio.tiering.gpu_tier import batch_size


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the torchrun world if not joined yet; a bare process becomes a world of 1.
    ``timeout_s``: every collective's wait (``distributed.timeout_s``)."""
    if comm.is_initialized():
        return
    env = launch_env()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    backend = "nccl" if cuda else "gloo"
    if env.launched:
        comm.init_world(backend, timeout_s)
    else:
        comm.init_local_world(timeout_s)


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", launch_env().local_rank)
    return torch.device("cpu")


class Engine:
    """DeepSpeed-style engine (DESIGN.md). Attributes other layers use are documented in
    docs/engine.md: ``config``, ``module``, ``partitioner``, ``optimizer``, ``lr_scheduler``,
    ``loss_scaler``, ``global_steps``, ``micro_steps``, ``global_samples``, ``skipped_steps``."""

    def __init__(self, *, model, config, model_parameters=None, optimizer=None,
                 lr_scheduler=None, frozen_ok: bool = False):
        init_distributed(collective_timeout(config))
        self.world_size = comm.world_size()
        self.global_rank = comm.rank()
        self.config = config if not isinstance(config, (str, os.PathLike, dict)) else (
            load_config(config, world_size=self.world_size))
        if self.config.world_size != self.world_size:
            raise ConfigError(f"config was resolved for world_size {self.config.world_size} but "
                              f"{self.world_size} ranks are running", key="train_batch_size")
        self.device = pick_device()
        self.module = model.to(self.device)
        spec = from_client(optimizer, self.config) if optimizer is not None else from_config(
            self.config.optimizer, model, model_parameters)
        if not frozen_ok:  # see ``initialize``
            require_trainable(spec, model)
        self.client_optimizer = optimizer
        policies = rule_policies(spec, self.config,
                                 resolve_engine_policies(self.config, self.device))
        # where every buffer lives ([Note: one placement]); checked before any allocation
        self.placement = engine_placement(self.config, self.module, spec, self.device, policies)
        policies = placed_policies(policies, self.placement)
        check_host_memory(self.config, self.module, spec, self.device, self.placement.estimate)
        self._precision = policies.precision  # bf16 optimizer state: engine.stats() sources
        self.optimizer = None
        with swap_cleanup(policies) as built:  # [Note: a failed initialize leaves no files]
            self.partitioner = build_partitioner(self.config, self.module, spec, self.device,
                                                 policies, self.placement)
            built.append(self.partitioner)
            self.gpu_tier = self.partitioner.gpu_tier()  # [Note: resident state yields]
            self._budgets = explicit_budgets(self.config)  # [Note: budgets in training]
            nvme_opt = self.config.zero_optimization.offload_optimizer.device == "nvme"
            shares = (fit_budgets(self.config, self.partitioner, self._held_cpu()) if nvme_opt
                      else None)
            self.optimizer = build_optimizer(self.config, self.partitioner, spec, shares,
                                             policies)
            built.append(self.optimizer)
            if not nvme_opt:  # in-memory moments count among the held state
                fit_budgets(self.config, self.partitioner, self._held_cpu())
        self.step_protocol = choose_protocol(  # step_protocol.py: decided once
            self.partitioner, self.optimizer, self.config.zero_optimization.offload_optimizer.device)
        self.loss_scaler = build_loss_scaler(self.config.fp16)
        self.lr_scheduler = self._scheduler(lr_scheduler)
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.training_dataloader = None  # set by initialize(training_data=...)
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._step_applied = False
        self._guard = StepGuard(self)  # [Note: atomic step] in step_guard.py
        self._phase = MicroStep()  # engine_state.[Note: the micro-step protocol]
        self._forced_boundary: bool | None = None
        self._load_failure: str | None = None  # set by a load that failed after it began writing
        self.last_save: dict | None = None  # this rank's report of its last checkpoint save
        self.show_progress = True  # checkpoint and model-save bars on rank 0 (docs/engine.md)
        self._timings: dict[str, float] = defaultdict(float)
        self._t0 = time.perf_counter()
        # [Note: per-step transfer stats]: merged counters at the last two step boundaries
        self._stats_at_boundary: dict | None = None
        self._stats_last_step: dict | None = None
        # [Note: step breakdown] in tiering/breakdown.py: stats()["breakdown"]
        self._timeline = StepTimeline(self.device, self.partitioner.step_clock())
        # steps_per_print: (time, samples, tokens, bytes_moved) at the last printed line
        self._tokens = 0
        self._print_mark: tuple[float, int, int, dict] = (time.perf_counter(), 0, 0, {})
        shutdown.track(self)  # closed at exit if still open: [Note: a clean exit]

    def _scheduler(self, client):
        if client is None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        if callable(client) and not hasattr(client, "step"):
            return client(self.optimizer)  # DeepSpeed accepts a factory taking the optimizer
        return client

    # ---- DeepSpeed surface -----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_usable()
        self._phase.check("forward")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            self._tokens += ids.numel()  # token ids: tokens/s in the steps_per_print line
        t = time.perf_counter()
        with self._timeline.span("forward"), torch.profiler.record_function("zeroio::forward"), \
                self._guard.watch():
            out = self.gpu_tier.forward(lambda: self.module(*args, **kwargs), batch_size(
                args, kwargs), rerunnable=self.partitioner.forward_rerunnable)
        self._timings["forward_s"] += time.perf_counter() - t
        self._phase.done("forward")
        return out

    def _check_usable(self, what: str = "forward") -> None:
        self._guard.check(what)
        if self._load_failure is not None:  # set by checkpoint/engine_io.load_checkpoint
            raise CheckpointError(self._load_failure)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._forced_boundary is not None:
            return self._forced_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's: the next micro-steps are (not) boundaries until set again (None: by count;
        accelerate ends an epoch's short accumulation this way)."""
        self._forced_boundary = is_boundary

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def step_gradients_ready(self) -> bool:
        """Whether the gradients the next optimizer step uses are final: ``backward`` has run at
        the accumulation boundary and ``step`` has not (``deepspeed.utils.safe_get_full_grad``)."""
        return self._phase.phase is Phase.BACKWARD_DONE and self.is_gradient_accumulation_boundary()

    def synchronize(self) -> None:
        """Wait for an overlapped optimizer step (``zero_optimization.tiering.overlap_step``);
        a no-op otherwise."""
        with self._timeline.reading("synchronize"), self._guard.watch():
            self.partitioner.wait_step()

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_grad(self) -> None:
        """Gradients are cleared after every optimizer step; kept for DeepSpeed-style loops."""

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale (fp16 loss scale, 1/accumulation) and backpropagate; hooks reduce gradients."""
        self._check_usable("backward")
        self._phase.check("backward", steps=self.global_steps, micro_steps=self.micro_steps)
        t = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        with self._timeline.span("backward"), torch.profiler.record_function("zeroio::backward"), \
                self._guard.watch():
            self.gpu_tier.before_backward()  # [Note: resident state yields]
            self.partitioner.begin_micro_step(boundary)
            scale = self.loss_scaler.scale / self.gradient_accumulation_steps()
            (loss.float() * scale).backward()
            self.partitioner.finalize_gradients(boundary)
            self.gpu_tier.after_backward()
        self._timings["backward_s"] += time.perf_counter() - t
        self._phase.done("backward")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Optimizer step at the accumulation boundary; counts the micro step always."""
        self._check_usable("step")
        self._phase.check("step", steps=self.global_steps, micro_steps=self.micro_steps)
        with preemption.uninterrupted():  # no signal cuts a step in two: it is raised after
            if self.is_gradient_accumulation_boundary():
                with self._phase.restart_on_failure(), \
                        self._guard.step(settle=self._settle_breakdown):  # [Note: atomic step]
                    t = time.perf_counter()
                    with self._timeline.span("step"), \
                            torch.profiler.record_function("zeroio::step"):
                        self._take_step(lr_kwargs or {})
                self._timings["step_s"] += time.perf_counter() - t
                self._stats_boundary()
                self._timeline.boundary(self.global_steps,
                                        (self._stats_last_step or {}).get("bytes_moved"))
                self._maybe_print()
            self.micro_steps += 1
            self._phase.done("step")

    def _take_step(self, lr_kwargs: dict) -> None:
        sq = self.partitioner.local_grad_sq_norm().to(torch.float64)
        sq = comm.all_reduce_scalar(sq.to(self._comm_device()))
        scale = self.loss_scaler.scale
        norm = math.sqrt(sq.item()) / scale if math.isfinite(sq.item()) else math.inf
        self._timeline.anchor()  # the device is idle after .item(): [Note: step breakdown]
        overflow = not math.isfinite(norm)  # see [Note: one all-reduce for norm and overflow]
        self._step_applied = not overflow
        if overflow:
            if not self.config.fp16.enabled:
                raise NonFiniteGradientError(
                    f"gradient norm is {norm} at step {self.global_steps} (no fp16 loss scaling "
                    "to skip it): check the loss and learning rate")
            self.skipped_steps += 1
            self.loss_scaler.update(True)
        else:
            clip = self.config.gradient_clipping
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            self.last_grad_norm = norm
            self.step_protocol.apply(self.optimizer, self.partitioner, self._guard,
                                     grad_scale=scale / coef)  # [Note: step protocols]
            self.loss_scaler.update(False)
            if self.client_optimizer is not None:
                # our step stands in for the client's: tell a torch LRScheduler bound to it
                # (it checks this flag to warn about scheduler-before-optimizer order)
                self.client_optimizer._opt_called = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        self.partitioner.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _settle_breakdown(self) -> None:
        """Close the last step's record before this step starts another host step: its host
        step was joined by this step's backward (else it is waited for here, as ``step``)."""
        self._timeline.settle(force=True)
        if self._timeline.pending:
            with self._timeline.reading("step"):
                self.partitioner.wait_step()
            self._timeline.settle(force=True)

    def _comm_device(self) -> torch.device:
        return self.device if comm.backend() == "nccl" else torch.device("cpu")

    # ---- reporting -------------------------------------------------------------------------

    def _stats_sources(self) -> dict[str, dict]:
        """Every counter source: the optimizer's tiered store (offload_optimizer nvme) and the
        partitioner's (host <-> device copies; stage 3's NVMe parameter store)."""
        sources: dict[str, dict] = {}
        store = self.optimizer.store
        if store is not None:
            sources["optimizer"] = store.stats()
            sources["optimizer"]["swap_plan"] = self.optimizer.swap_plan()
        sources.update(self.partitioner.stats_sources())
        sources["gpu_tier"] = self.gpu_tier.stats()
        sources["held"] = tstats.held_source(self._held_tensors())
        if self._precision.low:  # docs/engine.md, "bf16 optimizer state"
            sources["precision"] = {"master_dtype": self._precision.master,
                                    "optimizer_state_dtype": self._precision.states,
                                    "step_assist": "off (bf16 optimizer state)"}
        return sources

    def _held_tensors(self) -> list[torch.Tensor]:
        """[Note: tiers outside stores] in tiering/stats.py: what the partitioner and a
        ``ShardedAdam`` keep in memory outside any tiered store (a ``SwappedAdam``'s moments
        are in its store, reported by it)."""
        out = list(self.partitioner.held_tensors())
        if self.optimizer is not None:  # None while it is being built (fit_budgets)
            out += self.optimizer.held_tensors()
        return out

    def _held_cpu(self) -> int:
        return tstats.held_bytes(self._held_tensors()).get("cpu", 0)

    def _stats_boundary(self) -> None:
        """[Note: per-step transfer stats] Each source keeps its own step counters, reset at
        its own moments (the optimizer's store at its step, others never), so the engine
        takes ``last_step`` as the difference of the merged totals at consecutive optimizer
        steps: every source's traffic lands in the step it happened in, and the totals are
        exactly the sum of the per-step values."""
        now = tstats.merge(self._stats_sources())
        now.pop("sources")
        self._stats_last_step = tstats.diff(now, self._stats_at_boundary)
        self._stats_at_boundary = now

    def stats(self) -> dict[str, Any]:
        """DESIGN.md's ``engine.stats()``: since start, ``bytes_moved`` per tier pair
        ("nvme->cpu", "cpu->nvme", "cpu->gpu", "gpu->cpu", ...), ``stall_seconds`` (time the
        training thread waited on transfers or I/O), ``busy_seconds`` and ``hidden_fraction``
        (where in-flight time is measured), ``tiers`` (budget and used bytes summed over
        stores, plus the bytes the partitioner and optimizer hold outside stores: budget
        None where no store has that tier); ``last_step`` (the last optimizer step's values, same keys), ``step`` (since
        then); ``sources`` (each counter source as it reports itself); phase ``timings``;
        ``breakdown``: where the steps' time went ([Note: step breakdown], docs/tiering.md)."""
        self.synchronize()
        self._timeline.settle(force=True)
        sources = self._stats_sources()
        out: dict[str, Any] = tstats.merge(sources)
        for tier, budget in self._budgets.items():  # the user's budget, not the stores' shares
            out["tiers"].setdefault(tier, {"used_bytes": 0})["budget_bytes"] = budget
        out["last_step"] = self._stats_last_step
        out["step"] = tstats.diff(out, self._stats_at_boundary)
        out["timings"] = dict(self._timings)
        # the host step's worker: CPU Adam vs publication (step_overlap)
        out["timings"].update(self.partitioner.host_step_timings())
        out["breakdown"] = self._timeline.as_dict()
        out["placement"] = self.placement.to_dict()  # [Note: one placement]
        out["global_steps"] = self.global_steps
        out["skipped_steps"] = self.skipped_steps
        out["loss_scale"] = self.loss_scaler.scale
        out["last_save"] = self.last_save  # seconds, bytes written vs a full copy (docs/checkpoint.md)
        return out

    def _maybe_print(self) -> None:
        """[Note: steps_per_print] Rank 0 prints one line on stderr every ``steps_per_print``
        optimizer steps (None, DeepSpeed's default, never): step, lr, loss scale, samples/s
        (and tokens/s when the forward's ``input_ids`` or first argument holds token ids:
        this rank's count times the world size) and the bytes moved per tier pair since the
        previous line; with ``wall_clock_breakdown`` also the phase totals and the last step's
        transfers."""
        every = self.config.steps_per_print
        if not every or self.global_rank != 0 or self.global_steps % every:
            return
        now = time.perf_counter()
        moved = dict((self._stats_at_boundary or {}).get("bytes_moved", {}))
        t0, samples0, tokens0, moved0 = self._print_mark
        self._print_mark = (now, self.global_samples, self._tokens, moved)
        dt = max(now - t0, 1e-9)
        lr = ", ".join(f"{x:.4g}" for x in self.get_lr())
        rate = f"samples/s {(self.global_samples - samples0) / dt:,.1f}"
        if self._tokens > tokens0:
            rate += f" tokens/s {(self._tokens - tokens0) * self.world_size / dt:,.0f}"
        since = " ".join(f"{k} {_gb(v - moved0.get(k, 0))}" for k, v in sorted(moved.items())
                         if v - moved0.get(k, 0)) or "no transfers"
        line = (f"[zeroio] step {self.global_steps} lr {lr} loss_scale "
                f"{self.loss_scaler.scale:g} {rate} | moved since the last line: {since}")
        if self.config.wall_clock_breakdown:
            t = " ".join(f"{k.removesuffix('_s')} {v:.3f}s" for k, v in self._timings.items())
            line += f" | total {t} | last step {format_step_stats(self._stats_last_step)}"
            line += "\n" + format_breakdown(self._timeline.last)  # a host step still running:
            # the previous step's record ([Note: step breakdown])
        print(line, file=sys.stderr, flush=True)

    # ---- checkpoints (zeroio/checkpoint owns the format) -----------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        from zeroio.checkpoint import engine_io

        self._guard.check("save_checkpoint")  # never a half-applied step ([Note: atomic step])
        self._phase.check("save_checkpoint")
        self.synchronize()
        with preemption.uninterrupted():  # a checkpoint is written whole
            path = engine_io.save_checkpoint(self, save_dir, tag, client_state)
        self._keep_last(save_dir, path.name)
        return path

    def _keep_last(self, save_dir, saved: str) -> None:
        """checkpoint.keep_last: rank 0, which committed the tag, removes the tags beyond the
        newest N ([Note: keeping the newest N] in zeroio/checkpoint/retention.py); the names
        go into ``last_save["removed_tags"]`` (empty on the other ranks)."""
        from zeroio.checkpoint.retention import prune_tags

        keep = self.config.checkpoint.keep_last
        removed = prune_tags(save_dir, keep, saved=saved) if (
            keep is not None and self.global_rank == 0) else []
        self.last_save = {**(self.last_save or {}), "removed_tags": removed}

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True):
        from zeroio.checkpoint import engine_io

        self._phase.check("load_checkpoint")
        self._guard.before_load()  # a failed step's wait and kept I/O errors end here
        result = engine_io.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                           load_lr_scheduler_states)
        self._guard.loaded()
        self._phase.done("load")
        loader = self.training_dataloader
        if loader is not None and hasattr(loader.sampler, "resume"):
            loader.sampler.resume(self.global_samples)  # [Note: one global order] in data.py
        return result

    def save_16bit_model(self, save_dir, save_filename=None):
        from zeroio.checkpoint import export16

        self._guard.check("save_16bit_model")
        self._phase.check("save_16bit_model")
        self.synchronize()
        return export16.save_16bit_model(self, save_dir)

    def close(self) -> None:
        """Stop the engine's threads and remove its swap folders (docs/engine.md, "Closing an
        engine"); idempotent, and every later call on the engine is an EngineClosedError."""
        if self._phase.closed:
            return
        self._phase.close()
        try:
            self.synchronize()
        except StepFailedError:
            pass  # an overlapped step that failed: its state is dropped with the engine
        finally:
            try:
                self.partitioner.close()
            finally:
                self.optimizer.close()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}GB" if n >= 1e7 else f"{n / 1e6:.2f}MB"


def format_step_stats(s: dict | None) -> str:
    """One compact line of a step's transfer stats, e.g.
    ``nvme->cpu 5.44GB cpu->gpu 2.72GB stall 1.203s hidden 71%``."""
    if not s:
        return "no transfers"
    moved = " ".join(f"{k} {_gb(v)}" for k, v in s["bytes_moved"].items()) or "no transfers"
    hidden = s.get("hidden_fraction")
    tail = f" hidden {hidden:.0%}" if hidden is not None else ""
    return f"{moved} stall {s['stall_seconds']:.3f}s{tail}"


def _dataloader(engine: Engine, training_data, collate_fn):
    """DeepSpeed's training loader: micro batches of this rank's share of a resumable order."""
    if training_data is None:
        return None
    from zeroio.data import ResumableSampler

    sampler = ResumableSampler(training_data, num_replicas=engine.world_size,
                               rank=engine.global_rank)
    return torch.utils.data.DataLoader(
        training_data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
        collate_fn=collate_fn, drop_last=True)


def initialize(model=None, config=None, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collate_fn=None, config_params=None,
               **_unused):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader, lr_scheduler)``.
    A model with nothing to train (every parameter frozen) is a ConfigError here; the
    DeepSpeed facade builds it, as DeepSpeed does (a frozen reference model: ``build``)."""
    return build(model=model, config=config, model_parameters=model_parameters,
                 optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=training_data,
                 collate_fn=collate_fn, config_params=config_params)


def build(*, model=None, config=None, model_parameters=None, optimizer=None, lr_scheduler=None,
          training_data=None, collate_fn=None, config_params=None, frozen_ok: bool = False):
    """``initialize``'s four results; ``frozen_ok``: a model whose parameters are all frozen
    is built (DeepSpeed's facade: TRL's ``prepare_deepspeed`` wraps a frozen reference model
    that only runs forward), not refused."""
    if model is None:
        raise ConfigError("initialize(model=...) is required", key="model")
    config = config if config is not None else config_params
    if config is None:
        raise ConfigError("initialize(config=...) is required: a path or a dict", key="config")
    engine = Engine(model=model, config=config, model_parameters=model_parameters,
                    optimizer=optimizer, lr_scheduler=lr_scheduler, frozen_ok=frozen_ok)
    engine.training_dataloader = _dataloader(engine, training_data, collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
