"""Train, checkpoint and resume a LightningModule with Lightning's DeepSpeed strategy.

Written the way Lightning's docs write a DeepSpeed run: a ``LightningModule`` whose
``configure_model`` builds the layers (so ZeRO stage 3 partitions them as they are created),
``configure_optimizers`` returning AdamW and a step schedule, ``L.Trainer(strategy=...,
accelerator="gpu", devices=1, precision="bf16-mixed")``, ``trainer.fit``,
``trainer.save_checkpoint`` and ``trainer.fit(..., ckpt_path=...)``. The strategy is a name
(``deepspeed_stage_2``, ``deepspeed_stage_3``) or a DeepSpeed JSON file
(``DeepSpeedStrategy(config=...)``). Nothing in it names zeroio: under ``zeroio launch`` (or
with the one import line) Lightning's ``import deepspeed`` is zeroio's.

Writes ``OUT/losses.json``: every training step's loss (mean over ranks) of the first fit and
of the resumed fit, the global steps, the learning rate at the end, and rank 0's weights.
"""

import argparse
import json
import os

import lightning as L
import torch
from deepspeed.utils import safe_get_full_fp32_param
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset


class LitRegressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = None
        self.step_losses = []

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("train_loss", loss, sync_dist=True)
        mean = self.all_gather(loss.detach()).float().mean()
        self.step_losses.append(mean.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def trainer(args, max_epochs):
    strategy = args.strategy
    if strategy.endswith(".json"):
        strategy = DeepSpeedStrategy(config=strategy)
    return L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                     precision=args.precision, max_epochs=max_epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="deepspeed_stage_3")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    loader = DataLoader(dataset(), batch_size=8, shuffle=False)

    model = LitRegressor()
    first = trainer(args, max_epochs=2)
    first.fit(model, train_dataloaders=loader)
    ckpt = os.path.join(args.out, "lightning.ckpt")
    first.save_checkpoint(ckpt)

    resumed_model = LitRegressor()
    resumed = trainer(args, max_epochs=3)
    resumed.fit(resumed_model, train_dataloaders=loader, ckpt_path=ckpt)

    engine = resumed.strategy.deepspeed_engine
    weights = {name: safe_get_full_fp32_param(param).double().reshape(-1).tolist()
               for name, param in resumed_model.named_parameters()}
    if resumed.is_global_zero:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"first": model.step_losses, "resumed": resumed_model.step_losses,
                       "first_steps": first.global_step, "resumed_steps": resumed.global_step,
                       "lr": engine.get_lr(), "stage": engine.zero_optimization_stage(),
                       "weights": weights}, f)


if __name__ == "__main__":
    main()
