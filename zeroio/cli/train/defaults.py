"""The built-in config of `zeroio train` (used when no --config is given).

ZeRO stage 3 with parameters and optimizer state offloaded to NVMe (a folder
under the run's output directory), so the default run exercises the whole
tiered path: partitioned parameters swapped in for forward and backward,
Adam state read and written per sub-group. fp32 on CPU (gloo has no bf16
reduce worth using there), bf16 on GPU. Everything the command line decides
(batch, learning rate, steps, bucket sizes from the hidden size) is "auto" and
filled by ``load_config`` from the arguments, the same path a user's config
with "auto" keys takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def default_config(nvme_path: str | Path, *, cuda: bool) -> dict[str, Any]:
    """A DeepSpeed-schema dict: stage 3, offload_param + offload_optimizer to ``nvme_path``."""
    nvme = str(nvme_path)
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,  # the progress bar reports; no engine log lines
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            # 10 * hidden: small vectors (norms) stay whole on every rank; every matrix is
            # partitioned and swapped, which is what the default run is meant to show.
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": cuda},
            # read ahead / write behind when the moments outgrow the host budget (without
            # them such a swap is synchronous; state that fits is never written either way)
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": cuda,
                                  "pipeline_read": True, "pipeline_write": True},
        },
    }
