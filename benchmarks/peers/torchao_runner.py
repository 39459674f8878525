"""torchao contender: ``torchao.optim.CPUOffloadOptimizer`` (fused CPU AdamW) on one GPU.

Run by train_peers.py (``python torchao_runner.py --steps N ...``); prints one
JSON line (common.emit). The model stays fp32 on the GPU with bf16 autocast,
as the plain PyTorch row; torchao keeps the fp32 master copy and the Adam
moments in pinned CPU memory and steps them with torch's fused CPU AdamW,
copying gradients down and parameters up around the step. Gradients are not
offloaded during backward (``offload_gradients=False``, torchao's default) so
clipping at 1.0 sees every gradient, as in every other row. torchao's
optimizer is single-GPU: this row runs on one rank whatever ``--nproc`` is.
"""

from __future__ import annotations

import common
import torch


def main(argv=None) -> None:
    args = common.runner_parser(__doc__).parse_args(argv)
    spec = common.spec_from_args(args)

    from torchao.optim import CPUOffloadOptimizer  # carried to the GPU machine as a wheel

    device = common.pick_device()
    if device.type != "cuda":
        raise SystemExit("torchao's CPUOffloadOptimizer needs a CUDA (or XPU) device")
    host = common.HostPeak()
    model = common.build_model(spec).to(device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True,
                              **common.adamw_hyper())
    clock = common.Clock(device)
    batches = common.BatchStream(spec, 0)
    losses = []
    for _ in range(args.steps):
        ids = batches.next().to(device, non_blocking=True)
        clock.start()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        clock.stop()
        losses.append(float(loss.detach().float().item()))
    import torchao

    result = {"contender": "torchao-cpu", "world_size": 1, "num_params": spec.num_params,
              "torchao_version": torchao.__version__, "losses": losses,
              **common.summarize(clock.seconds, args.warmup, spec.tokens_per_step(1)),
              **common.peaks(device, host.stop())}
    common.emit(result)


if __name__ == "__main__":
    main()
