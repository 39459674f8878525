"""The training job of `zeroio train`, run once per rank (the launcher made the ranks).

Reads straight down: options -> distributed world -> config (built-in or the
user's, "auto" filled from the options) -> disk pre-flight (disk.py: fail
before the model exists when --output cannot take what the run writes) ->
model (inside ``zero.Init`` for stage 3) -> engine -> resume -> steps
(progress bar on rank 0) -> checkpoints -> consolidated ``from_pretrained``
folder (or, with --no-checkpoint, one written from the live engine) -> summary.

[Note: fresh runs start clean] Without ``--resume`` what zeroio wrote in the
run's checkpoint folder is deleted first: a stale checkpoint with a higher step
than the new run reaches would otherwise be the one a later ``--resume`` picks.
Files zeroio did not write are never deleted (the run refuses before launching
unless ``--overwrite``): [Note: run directory] in rundir.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zeroio.cli.train import disk, placement, rundir
from zeroio.cli.train.data import ByteTokenizer, ShardedOrder, TokenBlocks, read_text
from zeroio.cli.train.disk import MODEL_DTYPES
from zeroio.cli.train.model import build_model
from zeroio.cli.train.options import TrainOptions, check_job, check_options  # noqa: F401
from zeroio.cli.train.presets import num_parameters
from zeroio.cli.train.run_config import resolve_config  # noqa: F401 - callers import it here
from zeroio.config.launch_env import launch_env
from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm
from zeroio.preemption import StepBoundarySignals, stop_line


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def setup_world(timeout_s: float = 600.0) -> World:
    """Join the process group the launcher described (or a 1-rank one), gloo on CPU, NCCL on GPU;
    ``timeout_s``: every collective's wait (distributed.timeout_s)."""
    cuda = torch.cuda.is_available()
    env = launch_env()
    local_rank = env.local_rank
    if cuda:
        torch.cuda.set_device(local_rank)
    if not comm.is_initialized():
        if env.rank is None:  # run directly with --nproc 1: a world of one, no port
            comm.init_local_world(timeout_s)
        else:
            comm.init_world("nccl" if cuda else "gloo", timeout_s)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    w = comm.world()
    return World(rank=w.rank, world_size=w.world_size, local_rank=local_rank, device=device)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TB"


def swap_summary(stats: dict[str, Any]) -> str:
    """'nvme->cpu 1.2MB cpu->nvme 1.1MB' for the directions that moved anything."""
    moved = stats.get("bytes_moved", {}) if stats else {}
    return " ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(moved.items()) if v) or "none"


def _prepare_dirs(opts: TrainOptions, world: World, out: Path) -> Path:
    ckpt = out / "checkpoints"
    if world.local_rank == 0 and not opts.resume:  # see [Note: fresh runs start clean]
        rundir.remove_written(out, ("checkpoints", "nvme"), overwrite=opts.overwrite)
    if world.local_rank == 0:
        (out / "nvme").mkdir(parents=True, exist_ok=True)
        if not opts.no_checkpoint:
            ckpt.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    return ckpt


def write_model(ckpt: Path, tag: str, mcfg, model_dir: Path, *, progress: bool,
                dtype: torch.dtype = torch.float32, overwrite: bool = False) -> None:
    """Consolidate checkpoint ``tag`` into a from_pretrained folder (safetensors + config.json).

    The fp32 masters cast to ``dtype``, streamed shard by shard by the checkpoint
    layer, so a multi-billion-parameter model never sits whole in memory. What zeroio
    wrote there before goes first (no stale shards), and the new files are listed as its.
    """
    from zeroio.checkpoint import write_safetensors

    out = model_dir.parent
    rundir.remove_written(out, ("model",), overwrite=overwrite)
    rundir.record(out, [model_dir], claim=True)
    write_safetensors(ckpt, model_dir, tag, progress=progress, dtype=dtype)
    if not (model_dir / "config.json").is_file():
        mcfg.save_pretrained(model_dir)
    rundir.record(out, [model_dir])


def write_model_live(engine, mcfg, model_dir: Path, dtype: torch.dtype, *, rank0: bool,
                     overwrite: bool = False) -> None:
    """The same folder as `write_model`, from the live engine's fp32 masters (no checkpoint):
    collective, each window reduced onto rank 0, cast and streamed (export16.save_16bit_model)."""
    from zeroio.checkpoint.export16 import save_16bit_model

    if rank0:
        rundir.remove_written(model_dir.parent, ("model",), overwrite=overwrite)
        rundir.record(model_dir.parent, [model_dir], claim=True)
    comm.barrier()
    save_16bit_model(engine, model_dir, dtype=dtype)
    if rank0 and not (model_dir / "config.json").is_file():
        mcfg.save_pretrained(model_dir)
    if rank0:
        rundir.record(model_dir.parent, [model_dir])


def _resume_step(ckpt: Path, tag: str | None = None) -> int:
    """The step of the checkpoint --resume will pick (--tag, else ``latest``; "stepN"), or 0."""
    from zeroio.checkpoint.layout import LATEST

    if tag is None:
        try:
            tag = (ckpt / LATEST).read_text().strip()
        except OSError:
            return 0
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else 0


def _preflight(opts: TrainOptions, mcfg, cfg, world: World, out: Path) -> None:
    """Fail before the model is built when the output folder's file system cannot take what the
    run will write ([Note: what the run writes] in disk.py). Every rank checks; all fail together."""
    start = _resume_step(out / "checkpoints", opts.tag) if opts.resume else 0
    end = max(start, opts.steps if opts.stop_after is None else min(opts.steps, opts.stop_after))
    err = None
    try:
        plan = disk.plan(out=out, mcfg=mcfg, cfg=cfg, world_size=world.world_size, start=start,
                         end=end, save_every=opts.save_every, keep_last=cfg.checkpoint.keep_last,
                         checkpoint=not opts.no_checkpoint,
                         write_model=end >= opts.steps, model_dtype=opts.model_dtype,
                         fresh=not opts.resume, overwrite=opts.overwrite)
        disk.check(plan, checkpoint=not opts.no_checkpoint, model_dtype=opts.model_dtype)
        disk.check_nvme_reserve(cfg, numel=num_parameters(mcfg), world_size=world.world_size)
    except Exception as e:  # noqa: BLE001 - re-raised below, once every rank knows
        err = e
    ok = torch.tensor([0 if err else 1], dtype=torch.int32, device=world.device)
    comm.all_reduce_scalar(ok, op="min")
    if err is not None:
        raise err
    if not ok.item():
        raise ConfigError(f"the pre-flight disk check of --output {out} failed on another rank; "
                          "see its error", key="output")


def _resume(engine, ckpt: Path, say, tag: str | None = None) -> tuple[int, list[float]]:
    """(step to continue from, loss history) from checkpoint ``tag`` (None: the newest), or
    (0, []) if there is none."""
    path, client = engine.load_checkpoint(ckpt, tag=tag)
    if path is None:
        say(f"--resume: no checkpoint under {ckpt}; starting from step 0")
        return 0, []
    start = int(engine.global_steps)
    say(f"--resume: continuing from {path} at step {start}")
    return start, list((client or {}).get("losses", []))[:start]


def _save(engine, ckpt: Path, tag: str, losses: list[float], rank0: bool) -> None:
    """Checkpoint ``tag``; rank 0 lists its files (and ``latest``) as written by zeroio."""
    from zeroio.checkpoint.layout import LATEST

    if rank0:  # a save a crash interrupts is still known as zeroio's
        rundir.record(ckpt.parent, [ckpt / tag, ckpt / LATEST], claim=True)
    engine.save_checkpoint(ckpt, tag=tag, client_state={"losses": losses})
    if rank0:  # what --keep-last removed is no longer listed
        removed = [ckpt / t for t in engine.last_save.get("removed_tags", [])]
        rundir.record(ckpt.parent, [ckpt / tag, ckpt / LATEST, *removed])


def _one_step(engine, blocks: TokenBlocks, order: ShardedOrder, step: int, gas: int,
              world: World) -> float:
    """One optimizer step (``gas`` micro-steps); the loss averaged over micro-steps and ranks."""
    total = torch.zeros((), dtype=torch.float64)
    for micro in range(gas):
        batch = blocks.batch(order.indices(step * gas + micro))
        batch = {k: v.to(world.device, non_blocking=True) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach().double().cpu()
    mean = (total / gas).to(world.device)  # NCCL reduces device tensors only
    comm.all_reduce_scalar(mean)  # a rank that stopped answering is named
    step_loss = mean.item() / world.world_size
    if not math.isfinite(step_loss):
        raise FloatingPointError(f"loss became {step_loss} at step {step + 1}; "
                                 "lower --lr or check the data")
    return step_loss


def _report(summary: dict[str, Any], stats: dict[str, Any], opts: TrainOptions) -> None:
    """Rank 0's closing lines (or the one JSON object with --json); only one line on stderr
    for a run a signal stopped ([Note: stopping on a signal] in train_cmd.py)."""
    if summary["stopped_by"]:
        print(stop_line(summary), file=sys.stderr, flush=True)
    if opts.json:
        print(json.dumps(summary), flush=True)
        return
    if summary["stopped_by"]:
        return
    losses = summary["losses"]
    first = f"{losses[0]:.3f}" if losses else "-"
    last = f"{losses[-1]:.3f}" if losses else "-"
    tps = summary["tokens_per_s"]
    print(f"loss {first} -> {last} (step 1 -> {len(losses)}), "
          f"{summary['end_step'] - summary['start_step']} steps in {summary['wall_s']:.1f} s"
          + (f", {tps:,.0f} tokens/s" if tps else ""), flush=True)
    plan = summary.get("plan")
    if plan and plan["measured_step_s"] is not None:
        print(f"step time: measured {plan['measured_step_s']:.3f} s (median after step 1), "
              f"predicted {plan['predicted_step_s']:.3f} s ({plan['placement']}; the offload's "
              f"floor, bound by {plan['plan']['bound']})", flush=True)
    if not opts.quiet:
        print(f"swap (rank 0): {swap_summary(stats)}", flush=True)
        print(f"checkpoint: {summary['checkpoint'] or 'none (--no-checkpoint)'}", flush=True)
        if summary["model_dir"]:
            print(f"model: {summary['model_dir']} (AutoModelForCausalLM.from_pretrained)",
                  flush=True)


def train(opts: TrainOptions, run_plan: placement.RunPlan | None = None,
          signals: StepBoundarySignals | None = None) -> dict[str, Any]:
    """Run the job on this rank; rank 0 returns (and prints) the summary, others return {}.
    ``run_plan``: the job's plan when this process made it; a planned rank launched by the
    job's holder reads it from --output ([Note: planned runs] in placement.py). ``signals``:
    deferred SIGTERM/SIGINT, asked at each step boundary (train_cmd.py)."""
    from tqdm import tqdm

    import zeroio

    out = Path(opts.output)
    if run_plan is None and placement.planning(opts):
        run_plan = placement.read(out)
    launched = launch_env().world_size
    # [Note: checked before anything is written] in options.py: again in each rank
    mcfg, cfg = check_job(opts, 1 if launched is None else launched,
                          cuda=torch.cuda.is_available(), zero=run_plan.zero if run_plan else None)
    world = setup_world(cfg.distributed.timeout_s)
    rank0 = world.rank == 0
    show = rank0 and not opts.json and not opts.quiet

    def say(msg: str) -> None:
        if show:
            print(msg, file=sys.stderr, flush=True)

    _preflight(opts, mcfg, cfg, world, out)
    ckpt = _prepare_dirs(opts, world, out)
    blocks = TokenBlocks(ByteTokenizer().encode(read_text(opts.data)), opts.seq_len)
    micro_batch, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    order = ShardedOrder(num_blocks=len(blocks), world_size=world.world_size, rank=world.rank,
                         micro_batch=micro_batch, seed=opts.seed)
    zo = cfg.zero_optimization
    say(f"zeroio train: {opts.preset or opts.model_config or 'tiny'} "
        f"({num_parameters(mcfg) / 1e6:.2f}M params), {world.world_size} rank(s) on "
        f"{world.device.type}, ZeRO stage {zo.stage}, offload param "
        f"{zo.offload_param.device.value}, optimizer {zo.offload_optimizer.device.value}; "
        f"{len(blocks)} sequences of {opts.seq_len} tokens")

    engine, *_ = zeroio.initialize(model=build_model(mcfg, cfg, opts.seed), config=cfg)
    engine.show_progress = not (opts.quiet or opts.json)  # the checkpoint layer's save bars
    try:
        start, losses = _resume(engine, ckpt, say, opts.tag) if opts.resume else (0, [])
        end = max(start, opts.steps if opts.stop_after is None else min(opts.steps, opts.stop_after))
        if start >= opts.steps:
            say(f"already at step {start} of --steps {opts.steps}; nothing to train")
        tokens_per_step = world.world_size * micro_batch * gas * opts.seq_len
        bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", disable=not show,
                   dynamic_ncols=True, file=sys.stderr)
        every = opts.progress_every if rank0 else 0  # TrainOptions.progress_every
        t_start = time.perf_counter()
        saved_at = None
        step_times: list[float] = []
        swap = "none"
        mark = time.perf_counter()
        done = start
        for step in range(start, end):
            if signals is not None and signals.stop_now():  # every rank, same boundary
                break
            losses.append(_one_step(engine, blocks, order, step, gas, world))
            done = step + 1
            # engine.stats() waits for an overlapped host step (the next forward's to hide), so
            # the swap counters are read on the steps that print, not on every step
            edge = done in (start + 1, end)
            report = every > 0 and (edge or done % every == 0)
            if edge or report:
                swap = swap_summary(engine.stats())
            # a step's time is the loop's period (the wait for the previous step's overlapped
            # host step lands in the next forward), checkpoint saves left out
            now = time.perf_counter()
            step_times.append(now - mark)
            bar.set_postfix_str(f"loss {losses[-1]:.3f}  tok/s "
                                f"{tokens_per_step / step_times[-1]:,.0f}  swap {swap}",
                                refresh=False)
            bar.update(1)
            if report:
                print(f"step {done}/{opts.steps} loss {losses[-1]:.4f} "
                      f"{step_times[-1]:.2f} s/step {now - t_start:.0f} s "
                      f"swap {swap}", file=sys.stderr, flush=True)
            if opts.save_every and done % opts.save_every == 0:
                _save(engine, ckpt, f"step{done}", losses, rank0)
                saved_at = done
            mark = time.perf_counter()
        bar.close()
        wall = time.perf_counter() - t_start

        stopped = signals.stopped if signals is not None else None
        end = done if stopped is not None else end
        if (end > start and saved_at != end and not opts.no_checkpoint
                and not (stopped and opts.no_checkpoint_on_signal)):
            _save(engine, ckpt, f"step{end}", losses, rank0)
            saved_at = end
        comm.barrier()
        stats = engine.stats()
        model_dir = out / "model" if end >= opts.steps and end > 0 and not stopped else None
        if model_dir is not None:
            # the moments' swap files go before the export ([Note: what the run writes] in
            # disk.py); the export reads the masters, never the optimizer's swap
            engine.synchronize()
            engine.optimizer.close()
        if model_dir is not None and opts.no_checkpoint:
            write_model_live(engine, mcfg, model_dir, MODEL_DTYPES[opts.model_dtype], rank0=rank0,
                             overwrite=opts.overwrite)
        elif rank0 and model_dir is not None:
            write_model(ckpt, f"step{end}", mcfg, model_dir, progress=show,
                        dtype=MODEL_DTYPES[opts.model_dtype], overwrite=opts.overwrite)
        comm.barrier()
    finally:
        engine.close()
    summary = {
        "model": opts.preset or opts.model_config or "tiny",
        "params": num_parameters(mcfg),
        "world_size": world.world_size,
        "device": world.device.type,
        "stage": zo.stage,
        "offload_param": zo.offload_param.device.value,
        "offload_optimizer": zo.offload_optimizer.device.value,
        "offload_optimizer_ratio": zo.offload_optimizer.ratio,
        "sub_group_size": zo.sub_group_size, "placement": stats["placement"],
        # the budgets the engine's tiered store trained under (engine.stats())
        "tier_budgets": {t: v.get("budget_bytes") for t, v in stats.get("tiers", {}).items()},
        "start_step": start,
        "steps": opts.steps,
        "end_step": end,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "losses": losses,
        "tokens_per_s": tokens_per_step * (end - start) / wall if end > start else None,
        # without the first two steps (trace recording, first swaps, allocator warm-up)
        "steady_tokens_per_s": (tokens_per_step * (len(step_times) - 2) / sum(step_times[2:])
                                if len(step_times) > 2 else None),
        "step_seconds": step_times,
        "peak_gpu_bytes": (torch.cuda.max_memory_allocated(world.device)
                           if world.device.type == "cuda" else None),
        "wall_s": wall,
        "bytes_moved": dict(stats.get("bytes_moved", {})),
        "stall_seconds": stats.get("stall_seconds"),
        "checkpoint": (None if opts.no_checkpoint or (stopped and saved_at != end)
                       else str(ckpt / f"step{end}")),
        "model_dtype": opts.model_dtype,
        "model_dir": str(model_dir) if model_dir else None,
        "plan": run_plan.summary(step_times) if run_plan else None,
        "stopped_by": stopped.name if stopped else None,
        "exit_code": signals.exit_code if signals is not None else 0,
    }
    if rank0:
        _report(summary, stats, opts)
    comm.barrier()
    return summary if rank0 else {"exit_code": summary["exit_code"]}
