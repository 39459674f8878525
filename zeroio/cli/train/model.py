"""Building the Llama model of `zeroio train`, partitioned as it is created for stage 3.

[Note: Hugging Face init under zero.Init] transformers initialises weights in
``post_init`` (normal, std = initializer_range), after the submodules exist.
Under ``zero.Init`` those submodules' parameters are already partitioned
placeholders by then, so the init writes nothing and the weights keep
PyTorch's default (kaiming-uniform) values, which start training from a worse
loss. transformers does the gathering itself only for DeepSpeed, so here each
module's own parameters are gathered in turn (bounded memory: one module at a
time), rank 0 re-runs the model's ``_init_weights`` on it, and the gather
scatters the result back to every rank's shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    # transformers' smart_apply order: children first, then the module itself
    for child in module.children():
        yield from _post_order(child)
    yield module


def hf_init_partitioned(model) -> None:
    """Re-run ``model._init_weights`` on every module with its parameters gathered (see note)."""
    import zeroio

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for module in _post_order(model):
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with zeroio.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            if rank0:
                # transformers marks what its init already touched; those marks are its own
                for p in params:
                    if getattr(p, "_is_hf_initialized", False):
                        p._is_hf_initialized = False
                module._is_hf_initialized = False
                model._init_weights(module)


def build_model(mcfg, cfg, seed: int):
    """``LlamaForCausalLM(mcfg)``, inside ``zero.Init`` for stage 3 (same seed on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if cfg.zero_optimization.stage != 3:
        return LlamaForCausalLM(mcfg)
    import zeroio

    with zeroio.zero.Init(config=cfg):
        model = LlamaForCausalLM(mcfg)
    hf_init_partitioned(model)
    return model
