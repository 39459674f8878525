"""Building the Llama model of `zeroio train`, partitioned as it is created for stage 3.

``zero.Init`` gives a transformers model its own weight initialisation (normal,
std = initializer_range) module by module, see [Note: Hugging Face init under
zero.Init] in zeroio/partition/zero.py; nothing model-specific is needed here.
"""

from __future__ import annotations

import torch


def build_model(mcfg, cfg, seed: int):
    """``LlamaForCausalLM(mcfg)``, inside ``zero.Init`` for stage 3 (same seed on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if cfg.zero_optimization.stage != 3:
        return LlamaForCausalLM(mcfg)
    import zeroio

    with zeroio.zero.Init(config=cfg):
        return LlamaForCausalLM(mcfg)
