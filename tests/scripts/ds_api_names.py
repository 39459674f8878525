"""A DeepSpeed training script that uses the API names client code commonly reaches for.

Written the way DeepSpeed's docs and tutorials write them: ``import deepspeed``,
``deepspeed.comm`` for the script's own collectives, ``DeepSpeedConfig`` to read the batch
sizes, ``deepspeed.checkpointing`` around a block, the ``safe_get_full_*`` accessors after
backward, the ``zero_to_fp32`` helpers on the saved checkpoint, the ZeRO memory estimators,
``FusedLamb`` / ``DeepSpeedCPULion`` handed to ``initialize``. Nothing in it names zeroio.
Each rank prints one JSON line of what it saw; the test compares it with plain PyTorch.
"""

import argparse
import json
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live
from deepspeed.utils import (
    log_dist,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)
from deepspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 2)

    def block(self, x):
        return torch.tanh(self.fc1(x))

    def forward(self, x):
        return self.fc2(deepspeed.checkpointing.checkpoint(self.block, x))


def batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, 6, generator=g)
        s = x.sum(dim=1, keepdim=True)
        yield x, torch.cat([s.sin(), s.cos()], dim=1)


def as_list(t):
    return t.detach().double().cpu().reshape(-1).tolist()


def collectives(rank, world):
    device = get_accelerator().current_device_name()  # NCCL wants the rank's GPU

    def tensor(values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    t = tensor([rank + 1.0])
    dist.all_reduce(t)
    out = torch.zeros(2 * world, device=device)
    dist.all_gather_into_tensor(out, tensor([float(rank), 10.0 * rank]))
    mine = torch.zeros(2, device=device)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * world, device=device) + rank)
    b = tensor([rank * 7 + 3.0])
    dist.broadcast(b, src=world - 1)
    parts = [torch.zeros(1, device=device) for _ in range(world)]
    handle = dist.all_gather(parts, tensor([rank * 2.0]), async_op=True)
    handle.wait()
    avg = tensor([float(rank)])
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    return {"all_reduce": t.item(), "all_gather_into_tensor": as_list(out),
            "reduce_scatter_tensor": as_list(mine), "broadcast": b.item(),
            "all_gather": [p.item() for p in parts], "avg": avg.item(),
            "ranks": dist.get_all_ranks_from_group(dist.get_world_group())}


def train(engine, data, rank, per, grads=None):
    losses = []
    for x, y in data:
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        if grads is not None:  # between backward and step: the gradient the step will use
            grads.append({n: as_list(safe_get_full_grad(p))
                          for n, p in engine.module.named_parameters()})
        engine.step()
        losses.append(loss.item())
    return losses


def rule_engine(optimizer_cls, config, data, rank, per):
    torch.manual_seed(0)
    model = Net()
    opt = optimizer_cls(model.parameters(), lr=0.01, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    losses = train(engine, data, rank, per)
    return {"losses": losses, "params": {n: as_list(safe_get_full_fp32_param(p))
                                         for n, p in engine.module.named_parameters()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save_dir", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": world, "local_rank": dist.get_local_rank(),
           "comm": collectives(rank, world)}

    ds_config = DeepSpeedConfig(args.deepspeed_config)
    out["config"] = {"micro": ds_config.train_micro_batch_size_per_gpu,
                     "gas": ds_config.gradient_accumulation_steps,
                     "stage": ds_config.zero_optimization_stage,
                     "optimizer": ds_config.optimizer_name,
                     "same_class": deepspeed.DeepSpeedConfig is DeepSpeedConfig}
    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = Net()
    out["estimate3"] = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
    out["estimate2"] = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                   model_parameters=model.parameters())
    out["optimizer_is_ds"] = isinstance(optimizer, DeepSpeedOptimizer)
    per = GLOBAL_BATCH // world
    data = list(batches(args.steps + 1))
    grads = []
    out["losses"] = train(engine, data[:args.steps], rank, per, grads)
    out["grads"] = grads
    named = dict(engine.module.named_parameters())
    out["fp32"] = {n: as_list(safe_get_full_fp32_param(p)) for n, p in named.items()}
    out["exp_avg"] = {n: as_list(safe_get_full_optimizer_state(p, "exp_avg"))
                      for n, p in named.items()}
    out["exp_avg_sq"] = {n: as_list(safe_get_full_optimizer_state(p, "exp_avg_sq"))
                         for n, p in named.items()}
    engine.save_checkpoint(args.save_dir, tag="end")
    dist.barrier()
    out["consolidated"] = {n: as_list(t) for n, t in
                           get_fp32_state_dict_from_zero_checkpoint(args.save_dir).items()}
    if rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(args.save_dir, args.save_dir + "-fp32",
                                                   safe_serialization=True)
        loaded = load_state_dict_from_zero_checkpoint(Net(), args.save_dir, tag="end")
        out["loaded"] = {n: as_list(p) for n, p in loaded.named_parameters()}

    # set a master: the next forward uses it
    safe_set_full_fp32_param(named["fc2.bias"], torch.tensor([0.25, -0.5]))
    out["set_bias"] = as_list(safe_get_full_fp32_param(named["fc2.bias"]))
    x = data[-1][0][rank * per:(rank + 1) * per]
    out["after_set"] = as_list(engine(x.to(engine.device)))

    log_dist("log_dist says hello", ranks=[0])
    see_memory_usage("see_memory_usage after training", force=True)
    lamb_config = {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 2}}
    lion_config = {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}
    out["lamb"] = rule_engine(FusedLamb, lamb_config, data[:2], rank, per)
    out["lion"] = rule_engine(DeepSpeedCPULion, lion_config, data[:2], rank, per)
    errors = {}
    try:
        from deepspeed.pipe import PipelineModule  # noqa: F401
    except ImportError as e:
        errors["pipe"] = str(e)
    try:
        deepspeed.init_inference(model)
    except AttributeError as e:
        errors["init_inference"] = str(e)
    out["errors"] = errors
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
