"""Train a Llama-style model (random weights) with plain PyTorch or zeroio; print s/step and memory.

    # 1 GPU, the 1.36B model (defaults), plain PyTorch + fused AdamW on GPU:
    python benchmarks/train_llama.py --mode plain --steps 12
    # zeroio ZeRO-2 + CPU offload / + NVMe offload of the optimizer state:
    python benchmarks/train_llama.py --mode zeroio --config configs/zero2-cpu.json --steps 12
    python benchmarks/train_llama.py --mode zeroio --config configs/zero2-cpu.json \
        --offload nvme --nvme-path /tmp/zeroio-nvme --steps 12
    # CPU smoke test:
    python benchmarks/train_llama.py --mode zeroio --config configs/zero2-cpu.json --tiny

Prints one JSON object: s/step median after ``--warmup`` steps, tokens/s, peak
GPU memory (torch.cuda.max_memory_allocated), peak host RSS (psutil, sampled
every 20 ms), and for zeroio ``engine.stats()`` and ``breakdown`` (the last timed step's
``stats()["breakdown"]`` record and the mean over the timed steps: plot it with
benchmarks/plot_breakdown.py); also written to
benchmarks/results/train_llama-<mode>-<host>-<date>.json with machine, date
and commit. Under torchrun (``--nproc_per_node N``) every rank trains and
rank 0 reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time

import provenance  # benchmarks/provenance.py: ZEROIO_COMMIT on the device, else git
import psutil
import torch


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("plain", "zeroio"), default="plain")
    ap.add_argument("--config", help="zeroio / DeepSpeed JSON config (--mode zeroio)")
    ap.add_argument("--stage", type=int, help="override zero_optimization.stage")
    ap.add_argument("--offload", choices=("none", "cpu", "nvme"),
                    help="override zero_optimization.offload_optimizer.device")
    ap.add_argument("--nvme-path", help="offload_optimizer.nvme_path (with --offload nvme)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY.PATH=JSON",
                    help="override any config key, e.g. zero_optimization.reduce_bucket_size=5e7")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=1, metavar="N",
                    help="gradient_accumulation_steps: N micro-batches per optimizer step (a "
                         "timed step is N forward/backward passes and one optimizer step)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="activation (gradient) checkpointing of every decoder layer "
                         "(transformers' gradient_checkpointing_enable, non-reentrant)")
    ap.add_argument("--tiny", action="store_true",
                    help="hidden 64, 2 layers, vocab 256, seq 32, micro batch 2, 4 steps (smoke test)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the timed steps: 2 steps with device syncs between forward, "
                         "backward and step (phase seconds in the JSON), then 1 step under "
                         "torch.profiler (chrome trace + op table in DIR)")
    ap.add_argument("--zero-init", action="store_true",
                    help="--mode zeroio, stage 3: build the model inside zeroio.zero.Init(config) "
                         "(bf16 shards as modules are created; no whole fp32 model anywhere)")
    ap.add_argument("--mem-log", action="store_true",
                    help="print GPU (allocated, peak, reserved) and host RSS (now, peak) on stderr "
                         "after the build, the engine init and every step (a killed run still "
                         "shows where memory went)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    if a.tiny:
        a.hidden, a.layers, a.intermediate, a.heads, a.vocab = 64, 2, 128, 4, 256
        a.seq, a.micro_batch, a.steps, a.warmup = 32, 2, 4, 1
    return a


def build_model(a, zero_config: dict | None = None):
    """The Llama; inside ``zeroio.zero.Init(config=zero_config)`` when that is given (stage 3:
    parameters become 16-bit shards as each module is created, as ``zeroio train`` builds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers,
                      intermediate_size=a.intermediate, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads or a.heads, vocab_size=a.vocab,
                      max_position_embeddings=max(a.seq, 2048), tie_word_embeddings=False)
    torch.manual_seed(0)
    if zero_config is None:
        return LlamaForCausalLM(cfg)
    import zeroio

    with zeroio.zero.Init(config=zero_config):
        return LlamaForCausalLM(cfg)


def mem_line(what: str, rss: RssSampler | None) -> str:
    """One line of where memory is now (``--mem-log``)."""
    gib = 2**30
    parts = [f"mem {what}:"]
    if torch.cuda.is_available():
        parts.append(f"gpu alloc {torch.cuda.memory_allocated() / gib:.1f} peak "
                     f"{torch.cuda.max_memory_allocated() / gib:.1f} reserved "
                     f"{torch.cuda.memory_reserved() / gib:.1f} GiB;")
    now = psutil.Process().memory_info().rss
    parts.append(f"host rss {now / gib:.1f} peak {max(now, rss.peak if rss else 0) / gib:.1f} GiB"
                 f", available {psutil.virtual_memory().available / gib:.1f} GiB")
    return " ".join(parts)


class RssSampler:
    """Peak resident memory of this process and its children, sampled on a thread."""

    def __init__(self, period: float = 0.02):
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period):
        while not self._stop.is_set():
            try:
                rss = self._proc.memory_info().rss + sum(
                    c.memory_info().rss for c in self._proc.children(recursive=True))
            except psutil.Error:
                rss = 0
            self.peak = max(self.peak, rss)
            time.sleep(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _num_params(model) -> int:
    """Parameter count, also of a model built under zero.Init (whose parameters are empty
    placeholders: the partition registry keeps their true shapes)."""
    from math import prod

    from zeroio.partition.stage3.registry import true_shape

    return sum(prod(true_shape(p)) for p in model.parameters())


def _set(cfg: dict, path: str, value) -> None:
    node = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def zeroio_config(a) -> dict:
    if not a.config:
        raise SystemExit("--mode zeroio needs --config FILE")
    with open(a.config) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = a.micro_batch
    cfg["gradient_accumulation_steps"] = a.accumulation
    cfg.pop("train_batch_size", None)
    cfg["gradient_clipping"] = a.clip
    if a.stage is not None:
        _set(cfg, "zero_optimization.stage", a.stage)
    if a.offload:
        _set(cfg, "zero_optimization.offload_optimizer.device", a.offload)
    if a.nvme_path:
        _set(cfg, "zero_optimization.offload_optimizer.nvme_path", a.nvme_path)
    for item in a.set:
        key, _, raw = item.partition("=")
        _set(cfg, key, json.loads(raw))
    return cfg


def _one_step(a, engine, model, opt, ids, mark=lambda name: None):
    """One optimizer step over ``ids`` (one micro-batch per row block of --micro-batch rows:
    --accumulation of them); the last micro-batch's loss."""
    micro = ids.split(a.micro_batch) if ids.shape[0] > a.micro_batch else (ids,)
    for i, mb in enumerate(micro):
        if engine is None:
            with torch.autocast(mb.device.type, dtype=torch.bfloat16):
                loss = model(input_ids=mb, labels=mb).loss
            mark("forward")
            (loss / len(micro)).backward()
            mark("backward")
            if i == len(micro) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            loss = engine(input_ids=mb, labels=mb).loss
            mark("forward")
            engine.backward(loss)
            mark("backward")
            engine.step()  # an optimizer step at the accumulation boundary only
    mark("step")
    return loss


def optimizer_io(engine) -> dict | None:
    """The NVMe optimizer's swap traffic of the last optimizer step (``engine.stats()``'s
    ``sources.optimizer.last_step``): bytes each way, stall and busy seconds; None without one."""
    src = (engine.stats().get("sources") or {}).get("optimizer") if engine is not None else None
    if not src:
        return None
    last = src.get("last_step") or {}
    moved = last.get("bytes_moved") or {}
    return {"read_bytes": moved.get("nvme->cpu", 0), "write_bytes": moved.get("cpu->nvme", 0),
            "stall_s": last.get("stall_seconds", 0.0), "busy_s": last.get("busy_seconds", 0.0)}


def timed_breakdown(bd: dict, warmup: int) -> dict | None:
    """``engine.stats()["breakdown"]`` of the timed steps: the last one's full record and the
    mean of the timed steps' compact records (``recent``: steps after ``warmup``; docs/tiering.md,
    "Step breakdown"); None before any step."""
    if not bd or bd.get("last") is None:
        return None
    timed = [r for r in bd["recent"] if r["step"] > warmup] or bd["recent"]
    mean: dict = {}
    for key, v in timed[-1].items():
        vals = [r[key] for r in timed]
        if key == "waited_s":
            mean[key] = {k: statistics.fmean(w.get(k, 0.0) for w in vals) for k in v}
        elif isinstance(v, (int, float)) and all(isinstance(x, (int, float)) for x in vals):
            mean[key] = statistics.fmean(vals)
    span = mean.get("host_span_s") or 0.0
    mean["hidden_fraction"] = mean.get("hidden_s", 0.0) / span if span > 0 else None
    return {"last": bd["last"], "mean": mean, "steps": [r["step"] for r in timed]}


def _profile(a, engine, model, opt, device, gen, rank: int = 0) -> dict:
    """Where a step's time goes: synced phase seconds over 2 steps, then a profiler trace
    (every rank steps under the profiler; rank 0 writes the trace and the op table)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for _ in range(2):
        ids = torch.randint(0, a.vocab, (a.micro_batch * a.accumulation, a.seq), generator=gen).to(device)
        sync()
        last = [time.perf_counter()]

        def mark(name, last=last):
            sync()
            now = time.perf_counter()
            phases[name].append(now - last[0])
            last[0] = now

        _one_step(a, engine, model, opt, ids, mark)
    os.makedirs(a.profile, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    ids = torch.randint(0, a.vocab, (a.micro_batch * a.accumulation, a.seq), generator=gen).to(device)
    with torch.profiler.profile(activities=acts) as prof:
        _one_step(a, engine, model, opt, ids)
        sync()
    if rank != 0:
        return {k: statistics.median(v) for k, v in phases.items()}
    tag = f"{a.mode}-{os.path.basename(a.config or 'plain').removesuffix('.json')}"
    prof.export_chrome_trace(os.path.join(a.profile, f"trace-{tag}.json"))
    with open(os.path.join(a.profile, f"ops-{tag}.txt"), "w") as f:
        for key in ("cpu_time_total", "self_cpu_time_total") + (
                ("cuda_time_total",) if cuda else ()):
            f.write(f"== sorted by {key}\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
    return {k: statistics.median(v) for k, v in phases.items()}


def main() -> None:
    a = _args()
    after = os.environ.get("ZEROIO_TRACEBACK_AFTER_S")
    if after:  # a run about to be killed for time says where it was (train_peers sets it)
        import faulthandler

        faulthandler.dump_traceback_later(float(after), exit=False)
    cuda = torch.cuda.is_available()
    rss = RssSampler()
    log = (lambda what: print(mem_line(what, rss), file=sys.stderr, flush=True)) \
        if a.mem_log else (lambda what: None)
    if a.zero_init and a.mode != "zeroio":
        raise SystemExit("--zero-init needs --mode zeroio (and zero_optimization.stage 3)")
    model = build_model(a, zeroio_config(a) if a.zero_init else None)
    if a.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = _num_params(model)
    log(f"built {n_params / 1e9:.3f} B params")
    engine = None
    opt = None
    if a.mode == "plain":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
            torch.device("cpu")
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
        rank, world = 0, 1
    else:
        import zeroio
        from zeroio.io import progress

        cfg = zeroio_config(a)
        with progress.quiet(a.json or a.quiet):  # initialize's bars (masters to NVMe)
            engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
        device, rank, world = engine.device, engine.global_rank, engine.world_size
        log("engine initialized")
    gen = torch.Generator().manual_seed(rank)
    times = []
    show = not (a.json or a.quiet) and rank == 0
    steps = range(a.steps)
    if show:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"train_llama {a.mode}", unit="step")
    loss_val = float("nan")
    losses: list[float] = []
    norms: list[float | None] = []  # the gradient norm before clipping (zeroio rows)
    io_steps: list[dict | None] = []  # the NVMe optimizer's traffic per step
    # engine.stats() waits for an overlapped host step, so it is read per step only where the
    # optimizer swaps to NVMe (its per-step traffic); elsewhere a per-step read would serialize
    # the host step the next forward overlaps
    track_io = optimizer_io(engine) is not None
    if cuda:
        torch.cuda.synchronize()
    mark = time.perf_counter()
    for i in steps:
        ids = torch.randint(0, a.vocab, (a.micro_batch * a.accumulation, a.seq),
                            generator=gen).to(device)
        loss = _one_step(a, engine, model, opt, ids)
        if cuda:
            torch.cuda.synchronize()
        loss_val = loss.item()
        losses.append(loss_val)
        norms.append(getattr(engine, "last_grad_norm", None))
        io_steps.append(optimizer_io(engine) if track_io else None)
        io = io_steps[-1]
        if i == a.steps - 1 and engine is not None:
            engine.synchronize()  # the last step's host step belongs to it
        # a step's time is the loop's period: everything the loop did, including the wait for
        # the previous step's overlapped host step that the next forward takes
        now = time.perf_counter()
        times.append(now - mark)
        mark = now
        log(f"step {len(times)} {times[-1]:.2f} s loss {loss_val:.3f}" + (
            f" nvme read {io['read_bytes'] / 1e9:.2f} GB write {io['write_bytes'] / 1e9:.2f} GB"
            f" stall {io['stall_s']:.1f} s" if io else ""))
    # the timed steps' breakdown, before --profile adds steps (one optimizer step per loop)
    breakdown = timed_breakdown(engine.stats()["breakdown"], a.warmup) \
        if engine is not None else None
    phases = _profile(a, engine, model, opt, device, gen, rank) \
        if a.profile else None
    host_peak = rss.stop()
    timed = times[a.warmup:] or times
    s_step = statistics.median(timed)
    result = {
        "mode": a.mode, "config": a.config, "overrides": {"stage": a.stage, "offload": a.offload,
                                                          "set": a.set},
        "machine": platform.node(), "gpu": torch.cuda.get_device_name() if cuda else None,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": provenance.commit(),
        "world_size": world, "params": n_params,
        "model": {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "heads",
                                             "vocab", "seq", "micro_batch")},
        "steps": a.steps, "warmup": a.warmup, "s_per_step": s_step,
        "step_times": times, "accumulation": a.accumulation,
        "tokens_per_s": a.micro_batch * a.accumulation * a.seq * world / s_step,
        "grad_ckpt": a.grad_ckpt,
        "optimizer_io": io_steps,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_host_rss_gib": host_peak / 2**30, "final_loss": loss_val,
        "losses": losses, "grad_norms": norms,
        "stats": engine.stats() if engine is not None else None,
        "breakdown": breakdown,
        "phases": phases,
    }
    # 6 * N * tokens/s: the model FLOPs of forward and backward, recomputation not counted
    result["model_tflops"] = 6 * n_params * result["tokens_per_s"] / 1e12
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = os.path.join(a.out, f"train_llama-{a.mode}-{platform.node()}-{stamp}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
        if a.json:
            print(json.dumps(result, default=str))
        else:
            print(f"{a.mode}: {n_params / 1e9:.3f} B params, {s_step:.3f} s/step, "
                  f"{result['tokens_per_s']:.0f} tokens/s, {result['model_tflops']:.1f} model "
                  f"TFLOPS, peak GPU "
                  f"{result['peak_gpu_gib'] or 0:.1f} GiB, peak host RSS {host_peak / 2**30:.1f} GiB"
                  f"\nwrote {path}")
            if breakdown is not None:
                from zeroio.tiering.breakdown import format_breakdown

                print(format_breakdown(breakdown["last"]))
            timings = (result["stats"] or {}).get("timings") or {}
            if timings:  # the host step's worker thread, invisible to the profiler
                print("timings " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(timings.items())))
            for name, src in ((result["stats"] or {}).get("sources") or {}).items():
                if name.endswith("step_assist"):  # the GPU's share of the host step
                    gpu, cpu = src["numel_gpu"], src["numel_cpu"]
                    print(f"step assist: {gpu / max(1, gpu + cpu):.1%} of the host step's "
                          f"elements on the GPU ({gpu} of {gpu + cpu})")
    if engine is not None:
        engine.close()


if __name__ == "__main__":
    main()
