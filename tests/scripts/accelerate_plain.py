"""A training loop written the way accelerate's docs write one: ``Accelerator()``,
``accelerator.prepare(model, optimizer, loader)``, ``accelerator.backward(loss)``,
``optimizer.step()``, ``accelerator.gather`` for the logged loss and
``accelerator.get_state_dict`` for the weights. Where DeepSpeed comes in is the accelerate
config file's business (``distributed_type: DEEPSPEED``); nothing here names zeroio or
DeepSpeed. Writes ``OUT/result.json`` on the main process: every step's loss (mean over
processes), the process count, the prepared model's class and the full weights."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    model.train()
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "processes": accelerator.num_processes,
                       "model": type(model).__name__,
                       "weights": {k: v.double().reshape(-1).tolist() for k, v in state.items()}},
                      f)


if __name__ == "__main__":
    main()
