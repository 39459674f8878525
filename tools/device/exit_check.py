"""A stage-3 run through the Python API that ends right after its last step (no close()):
the case whose interpreter exit used to abort ("terminate called without an active
exception", exit 134) on a GPU. Run it several times under each launcher; every exit must be 0.

    python3 -m zeroio.cli launch --nproc 1 --no_local_rank tools/device/exit_check.py
"""

import torch

import zeroio

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
engine, *_ = zeroio.initialize(model=model, config=config)
device = next(engine.module.parameters()).device
for _ in range(3):
    x = torch.randn(8, 4096, device=device, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
print("trained", engine.global_steps, flush=True)
