"""The dtype names of the config and the checkpoint manifest, and their torch dtypes."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
"""``Config.compute_dtype`` names ("fp32", "bf16", "fp16") -> torch dtypes."""

__all__ = ["DTYPES"]
