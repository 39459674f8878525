"""zero.Init gives a Hugging Face model transformers' own initialisation.

Reference: the same ``LlamaForCausalLM`` built without zero.Init from the
same seed. On CPU the random draws happen in the same order (see [Note:
Hugging Face init under zero.Init] in zeroio/partition/zero.py), so every
gathered tensor must be bit-identical to the reference; independently of
that, the statistics HF's ``_init_weights`` promises are checked (linear and
embedding std = initializer_range, norm weights 1), which torch's default
(kaiming-uniform, std = 1/sqrt(3*fan_in)) would fail for these shapes.
"""

from __future__ import annotations

import pytest

from zeroio.testing import run_ranks

STD = 0.02


def _llama(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                       max_position_embeddings=64, tie_word_embeddings=tied,
                       initializer_range=STD, use_cache=False)


def _reference(tied: bool) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    model = LlamaForCausalLM(_llama(tied))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _built_under_init(tied: bool):
    import torch
    from transformers import LlamaForCausalLM

    import zeroio

    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(7)
    with zeroio.zero.Init(config=cfg):
        model = LlamaForCausalLM(_llama(tied))
    empty = all(p.numel() == 0 for p in model.parameters())
    params = dict(model.named_parameters())
    with zeroio.zero.GatheredParameters(list(params.values())):
        values = {n: p.detach().clone() for n, p in params.items()}
    same_object = model.lm_head.weight is model.model.embed_tokens.weight
    ref = _reference(tied)
    return dict(empty=empty, tied=same_object,
                equal={n: torch.equal(values[n], ref[n]) for n in ref},
                names=sorted(values) == sorted(ref),
                std={n: v.float().std().item() for n, v in values.items()},
                ones={n: bool((v == 1).all()) for n, v in values.items() if "norm" in n})


@pytest.mark.parametrize("tied", [False, True])
def test_hf_init_under_zero_init_matches_plain_build(tied):
    for r in run_ranks(_built_under_init, 2, tied, timeout=180):
        assert r["empty"], "parameters must be placeholders after zero.Init"
        assert r["tied"] is tied
        assert r["names"]
        assert all(r["ones"].values()) and r["ones"], r["ones"]
        for name, std in r["std"].items():
            if "norm" not in name:  # HF: normal(0, initializer_range); torch's default is ~0.036+
                assert abs(std - STD) < 0.05 * STD, (name, std)
        bad = [n for n, ok in r["equal"].items() if not ok]
        assert not bad, f"differ from the plain build with the same seed: {bad}"
