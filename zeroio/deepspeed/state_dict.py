"""DeepSpeed's ``_zero3_consolidated_16bit_state_dict``: the full state dict on rank 0.

Every rank must call it (each module's parameters are gathered in turn); rank 0
gets every parameter and buffer as a CPU tensor in the parameters' own dtype,
the other ranks an empty dict, as with DeepSpeed. A parameter shared by two
modules (tied embeddings) appears under both names, as in ``state_dict()``.
"""

from __future__ import annotations

import torch

from zeroio.partition.zero import GatheredParameters


def consolidated_state_dict(module: torch.nn.Module, rank: int,
                            exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        params = [(n, p) for n, p in m.named_parameters(recurse=False)
                  if not (exclude_frozen_parameters and not p.requires_grad)]
        missing = [p for _, p in params if id(p) not in seen]
        with GatheredParameters(missing):
            for name, p in params:
                if id(p) not in seen and rank == 0:
                    seen[id(p)] = p.detach().to("cpu", copy=True)
                if rank == 0:
                    out[dot + name] = seen[id(p)]
                else:
                    seen.setdefault(id(p), p)
        if rank == 0:
            for name, b in m.named_buffers(recurse=False):
                if name not in m._non_persistent_buffers_set and b is not None:
                    out[dot + name] = b.detach().to("cpu", copy=True)
    return out


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """DeepSpeed's helper: ``item`` with every tensor cloned (views to their own storage)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
