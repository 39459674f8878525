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

import argparse
import json
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_spec_args(parser)
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config (configs.py)")
    parser.add_argument("--name", default="deepspeed")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
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
    if rank == 0:
        common.emit(result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
