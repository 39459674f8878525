"""CUDA test helpers: skip without enough devices, and a device whose fp32 matmuls compare
with a CPU reference (TF32 off)."""

from __future__ import annotations

import torch


def need_cuda(n: int) -> None:
    """Skip the calling test unless ``n`` CUDA devices are visible."""
    import pytest

    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


def exact_cuda_device() -> torch.device:
    """This rank's current CUDA device, with TF32 switched off for matmuls and cuDNN: fp32
    results then differ from the CPU reference by summation order only."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())
