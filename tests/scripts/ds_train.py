"""A training script written the way DeepSpeed's getting-started docs write one.

Nothing in it names zeroio: under `zeroio launch` the ``import deepspeed`` below
is zeroio's. Trains a small regression MLP for ``--steps`` steps on a global
batch that every world size splits the same way (rank r takes rows
[r*B/W, (r+1)*B/W)), so data-parallel training equals one process on the full
batch. Saves a checkpoint after ``--save_at`` steps, trains on, loads it back
and trains the same steps again. Prints one JSON line per rank.
"""

import argparse
import json
import os
import sys

import deepspeed
import torch

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def get_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--save_dir", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, 6, generator=g)
        yield x, x.sum(dim=1, keepdim=True).sin()


def main():
    cmd_args = get_args()
    local_rank_arg = cmd_args.local_rank
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with open(cmd_args.deepspeed_config) as f:
        stage = json.load(f)["zero_optimization"]["stage"]

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cmd_args.deepspeed_config, remote_device="cpu",
                             pin_memory=False, enabled=stage == 3, dtype=torch.float32):
        model = Net()
    params = filter(lambda p: p.requires_grad, model.parameters())
    model_engine, optimizer, _, _ = deepspeed.initialize(args=cmd_args, model=model,
                                                         model_parameters=params)

    data = list(batches(cmd_args.steps))
    per = GLOBAL_BATCH // world

    def train(steps):
        out = []
        for x, y in steps:
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            loss = model_engine(x.to(model_engine.device), y.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            out.append(loss.item())
        return out

    losses = train(data[:cmd_args.save_at])
    model_engine.save_checkpoint(cmd_args.save_dir, tag="mid",
                                 client_state={"step": cmd_args.save_at})
    losses += train(data[cmd_args.save_at:])
    _, client_state = model_engine.load_checkpoint(cmd_args.save_dir, tag="mid")
    again = train(data[client_state["step"]:])

    with deepspeed.zero.GatheredParameters(list(model_engine.module.parameters())):
        checksum = sum(float(p.detach().double().sum()) for p in model_engine.module.parameters())
    engine = {"type": f"{type(model_engine).__module__}.{type(model_engine).__qualname__}",
              "is_ds_engine": isinstance(model_engine, deepspeed.DeepSpeedEngine),
              "stage": model_engine.zero_optimization_stage(),
              "local_rank": model_engine.local_rank == int(os.environ["LOCAL_RANK"]),
              "train_batch_size": model_engine.train_batch_size(),
              "gas": model_engine.gradient_accumulation_steps(),
              "boundary": model_engine.is_gradient_accumulation_boundary(),
              "lr": model_engine.get_lr(), "has_optimizer": model_engine.optimizer is not None}
    with model_engine.no_sync():
        pass
    line = json.dumps({"rank": rank, "world_size": world, "local_rank_arg": local_rank_arg,
                       "engine": engine,
                       "args_local_rank": cmd_args.local_rank, "losses": losses, "again": again,
                       "client_state": client_state, "checksum": checksum,
                       "steps": model_engine.global_steps})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
