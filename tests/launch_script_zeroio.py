"""A 2-rank training script for the launcher tests: only zeroio.initialize, no launcher API.

Trains a small MLP for a few steps on data that differs per rank and prints one
JSON line per rank: rank, world size, losses, and a checksum of the parameters
after training (equal on every rank when data parallelism works).
"""

import json
import os
import sys

import torch

import zeroio


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2},
    }
    if mode == "accelerate":
        from accelerate import Accelerator

        from zeroio.integrations.accelerate import initialize_from_accelerator

        config["gradient_accumulation_steps"] = "auto"
        engine, *_ = initialize_from_accelerator(Accelerator(cpu=True), model, config)
    else:
        engine, *_ = zeroio.initialize(model=model, config=config)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    checksum = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
    line = json.dumps({"rank": rank, "world_size": engine.world_size, "losses": losses,
                       "checksum": checksum, "steps": engine.global_steps})
    # one write() of < 4 KiB: atomic on a pipe, so the two ranks' lines never interleave
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    engine.close()
    # torch's rule for every script: without this, gloo's worker threads can abort the
    # interpreter at exit ("terminate called without an active exception", pytorch#190489)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
