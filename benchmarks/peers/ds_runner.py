"""DeepSpeed contender: ``deepspeed.initialize`` on the shared model with one of configs.py's files.

Run by train_peers.py (``python ds_runner.py --config FILE --steps N ...``,
under torch.distributed.run for several ranks); prints one JSON line
(common.emit). Stage 3 builds the model inside ``deepspeed.zero.Init`` as a
DeepSpeed user would (and as train_llama.py does with ``zeroio.zero.Init``).
DeepSpeed's CPU Adam and async-I/O ops compile on first use; train_peers.py
sets TORCH_CUDA_ARCH_LIST and the libaio paths for this process, and the
compile falls inside the warm-up (it happens in ``initialize``, before step 0).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import common
import torch

ZEROIO_ONLY_KEYS = (("zero_optimization", "tiering"),)
"""zeroio's own keys (docs/config.md): DeepSpeed's config models forbid unknown keys."""


def deepspeed_view(cfg: dict) -> dict:
    """``cfg`` without zeroio-only keys, so a config written for both engines (say with
    ``zero_optimization.tiering.overlap_step``) passes DeepSpeed's validation."""
    out = json.loads(json.dumps(cfg))
    for path in ZEROIO_ONLY_KEYS:
        node = out
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def zenflow_summary(step_seconds: list[float], zenflow: dict, tokens_per_step: int) -> dict:
    """ZenFlow's ordinary steps are short and every ``update_interval``-th is long (the CPU
    update lands), so a median shows only the short ones. Its s/step is the mean over whole
    update windows after the first update: steps U .. U*(1+k)-1 for the most whole windows
    the run has (step U-1, 0-based, is the first update). Fewer than one whole window: the
    mean of every step after the first update, flagged ``partial``."""
    interval = zenflow.get("update_interval")
    if not isinstance(interval, int) or interval < 1:
        return {"zenflow_note": f"update_interval {interval!r} is not a fixed step count: "
                                "median reported"}
    after = step_seconds[interval:]
    whole = len(after) // interval * interval
    window = after[:whole] if whole else after
    if not window:
        return {"zenflow_note": "no step after the first update: median reported"}
    mean = sum(window) / len(window)
    return {"s_per_step": mean, "tokens_per_s": tokens_per_step / mean,
            "s_per_step_median": statistics.median(step_seconds[interval:] or step_seconds),
            "zenflow_windows": whole // interval, "zenflow_update_interval": interval,
            "zenflow_note": ("mean over whole update windows after the first update"
                             if whole else "partial window: mean of the steps after the first update")}


def main(argv=None) -> None:
    parser = common.runner_parser(__doc__)
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config (configs.py)")
    parser.add_argument("--name", default="deepspeed")
    args = parser.parse_args(argv)
    spec = common.spec_from_args(args)
    cfg = deepspeed_view(json.loads(Path(args.config).read_text()))

    import deepspeed  # not a zeroio dependency: carried to the GPU machine as a wheel

    device = common.pick_device()
    rank, world = common.init_world(device)
    # deepspeed.comm wraps the world above; without it zero.Init's config sees world size 1
    # and asserts train_batch_size == micro batch (stage 3 at 2 ranks)
    deepspeed.init_distributed()
    host = common.HostPeak()
    t0 = time.perf_counter()
    if cfg["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = common.build_model(spec)
    else:
        model = common.build_model(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    init_s = time.perf_counter() - t0
    clock = common.Clock(device)
    batches = common.BatchStream(spec, rank)
    losses = []
    for _ in range(args.steps):
        ids = batches.next().to(engine.device, non_blocking=True)
        clock.start()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        clock.stop()
        losses.append(float(loss.detach().float().item()))
    result = {"contender": args.name, "world_size": world, "num_params": spec.num_params,
              "deepspeed_version": deepspeed.__version__, "init_seconds": init_s,
              "losses": losses,
              **common.summarize(clock.seconds, args.warmup, spec.tokens_per_step(world)),
              **common.peaks(device, host.stop())}
    zenflow = cfg["zero_optimization"].get("zenflow")
    if zenflow:
        result.update(zenflow_summary(clock.seconds, zenflow, spec.tokens_per_step(world)))
    if rank == 0:
        common.emit(result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
