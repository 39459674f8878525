"""The DeepSpeed-schema configs that zeroio and DeepSpeed both run, built per benchmark run.

One dict per offload setup, fed unchanged to ``zeroio.initialize`` (through
train_llama.py) and to ``deepspeed.initialize`` (ds_runner.py), so the two
engines are compared on the same written config. Batch keys come from the
run (micro batch per rank, no accumulation), the optimizer is AdamW with
common.adamw_hyper(), clipping 1.0, bf16.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from common import ModelSpec, adamw_hyper


class Setup(enum.Enum):
    """Where the training state lives; the value is the name used in contender names."""

    Z2_CPU = "z2-cpu"
    Z3_CPU = "z3-cpu"
    Z3_NVME = "z3-nvme"
    Z3_NVME_STREAM = "z3-nvme-stream"
    """zeroio only: Z3_NVME with the optimizer's host budget a quarter of the moments, so
    most of the optimizer state goes through the disk every step (the disk-bound case)."""

    Z2_ZENFLOW = "z2-zenflow"
    """DeepSpeed ZenFlow at stage 2: top-k gradient columns stepped on the GPU each step, the
    rest applied by the CPU every ``update_interval`` steps (not exact AdamW)."""
    Z3_ZENFLOW = "z3-zenflow"
    Z3_TWIN = "z3-twinflow"
    """Stage 3 + CPU with ``offload_optimizer.ratio`` 0.8 (80% of the step on the CPU, the
    rest on the GPU) and ``sub_group_size`` 1e8: DeepSpeed's twin-flow."""
    Z3_SUPER = "z3-superoffload"
    """Stage 3 + CPU with ``offload_optimizer.super_offload``: DeepSpeed's SuperOffload."""

    @property
    def on_nvme(self) -> bool:
        return self in (Setup.Z3_NVME, Setup.Z3_NVME_STREAM)


ZENFLOW: dict[str, Any] = {"topk_ratio": 0.05, "select_strategy": "auto",
                           "select_interval": "auto", "update_interval": 4,
                           "full_warm_up_rounds": 0, "overlap_step": True}
"""ZenFlow's settings from DeepSpeed's ZenFlow tutorial: 5% of gradient columns on the GPU,
the CPU update every 4 steps, overlapped with the next steps."""
ZENFLOW_SETUPS = (Setup.Z2_ZENFLOW, Setup.Z3_ZENFLOW)


def ds_config(setup: Setup, spec: ModelSpec, world: int, nvme_dir: Path | None) -> dict[str, Any]:
    """The config dict for ``setup``; ``nvme_dir`` is required for the NVMe setups."""
    hyper = adamw_hyper()
    zero: dict[str, Any]
    if setup in ZENFLOW_SETUPS:
        base = Setup.Z2_CPU if setup is Setup.Z2_ZENFLOW else Setup.Z3_CPU
        cfg = ds_config(base, spec, world, nvme_dir)
        cfg["zero_optimization"]["zenflow"] = dict(ZENFLOW)
        return cfg
    if setup in (Setup.Z3_TWIN, Setup.Z3_SUPER):
        cfg = ds_config(Setup.Z3_CPU, spec, world, nvme_dir)
        zero = cfg["zero_optimization"]
        if setup is Setup.Z3_TWIN:
            zero["offload_optimizer"]["ratio"] = 0.8
            zero["sub_group_size"] = 100_000_000
        else:
            zero["offload_optimizer"]["super_offload"] = True
        return cfg
    if setup is Setup.Z2_CPU:
        zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    elif setup is Setup.Z3_CPU:
        zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True}}
    else:
        if nvme_dir is None:
            raise ValueError("the z3-nvme setup needs --nvme-dir (a folder on the NVMe disk)")
        path = str(nvme_dir)
        zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                "offload_optimizer": {"device": "nvme", "nvme_path": path, "pin_memory": True},
                "offload_param": {"device": "nvme", "nvme_path": path, "pin_memory": True}}
        if setup is Setup.Z3_NVME_STREAM:
            # a quarter of this rank's Adam moments (8 bytes per parameter) in host memory
            moments = 8 * -(-spec.num_params // world)
            zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
            # cpu_budget_bytes bounds all host state (docs/tiering.md, "Budgets in
            # training"): the estimate's host bytes without the optimizer's derived swap
            # buffers, plus the quarter of the moments
            from zeroio.estimate import estimate_memory

            est = estimate_memory(spec.num_params, gpus_per_node=world, stage=3,
                                  offload_optimizer="nvme", offload_param="nvme", dtype="bf16")
            host = sum(i.bytes_per_gpu for i in est.items if i.tier == "cpu"
                       and i.name != "optimizer swap buffers (pinned)")
            zero["tiering"] = {"cpu_budget_bytes": host + moments // 4}
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.micro_batch * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {
            "lr": hyper["lr"], "betas": list(hyper["betas"]), "eps": hyper["eps"],
            "weight_decay": hyper["weight_decay"]}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def write_config(cfg: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path
