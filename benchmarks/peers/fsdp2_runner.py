"""FSDP2 contender: ``fully_shard`` per decoder layer + root, CPUOffloadPolicy, fused CPU AdamW.

Run by train_peers.py (``python fsdp2_runner.py --steps N ...``, or under
torch.distributed.run for several ranks); prints one JSON line (common.emit).
Parameters stay fp32 and sharded in (pinned) CPU memory; forward/backward run
in bf16 (MixedPrecisionPolicy, gradients reduced in fp32); the optimizer is
torch's fused AdamW stepping the CPU shards — what a PyTorch user gets today
for "optimizer and parameters on the CPU". On a machine without CUDA it runs
on the CPU with gloo (the offload policy then moves nothing, but the code
path is the same), which is what the CPU tests exercise.
"""

from __future__ import annotations

import common
import torch


def shard(model: torch.nn.Module, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)


def main(argv=None) -> None:
    args = common.runner_parser(__doc__).parse_args(argv)
    spec = common.spec_from_args(args)

    device = common.pick_device()
    # FSDP2's CPU-offloaded gradients reduce their norm on the CPU (clip_grad_norm_), which
    # NCCL alone cannot: "No backend type associated with device type cpu" at 2 ranks
    rank, world = common.init_world(device, cpu_collectives=True)
    host = common.HostPeak()
    model = common.build_model(spec)
    shard(model, device)
    hyper = common.adamw_hyper()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    clock = common.Clock(device)
    batches = common.BatchStream(spec, rank)
    losses = []
    for _ in range(args.steps):
        ids = batches.next().to(device, non_blocking=True)
        clock.start()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.stop()
        losses.append(float(loss.detach().float().item()))
    result = {"contender": "fsdp2-cpu", "world_size": world, "num_params": spec.num_params,
              "losses": losses,
              **common.summarize(clock.seconds, args.warmup, spec.tokens_per_step(world)),
              **common.peaks(device, host.stop())}
    if rank == 0:
        common.emit(result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
