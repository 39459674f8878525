"""zero.Init: a model larger than the memory cap set for each rank is built partitioned and trains.

The cap is checked on the process's peak resident set (``ru_maxrss``): while
the model is built under ``zero.Init`` on 2 ranks, the peak may grow by at
most 80% of the model's full fp32 size (a replicated build grows by 100%,
plus allocator slack). glibc is told to return large blocks at once
(MALLOC_MMAP_THRESHOLD_), so freed full parameters do not linger in its heap.
"""

from __future__ import annotations

from zeroio.testing import run_ranks

ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _cfg():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, vocab_size=2048,
                       max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)


def _build_and_train():
    import resource

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroio
    from zeroio.partition.stage3 import registry

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    warm = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=256)
    with zeroio.zero.Init(config=cfg):  # touch the code paths once (library pages count in RSS)
        LlamaForCausalLM(warm)
    torch.manual_seed(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with zeroio.zero.Init(config=cfg):
        model = LlamaForCausalLM(_cfg())
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    full_bytes = sum(registry.INIT_SHARDS[p].numel * 4 for p in model.parameters())
    empty = all(p.numel() == 0 for p in model.parameters())
    # every rank holds the same initial values: gather one weight and compare across ranks
    w = model.model.layers[0].mlp.up_proj.weight
    with zeroio.zero.GatheredParameters([w]):
        checksum = torch.tensor([w.double().sum().item()], dtype=torch.float64)
        shape = tuple(w.shape)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    engine, _, _, _ = zeroio.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 2048, (2, 16), generator=g)
    losses = []
    for _ in range(4):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return dict(grown=grown, full=full_bytes, empty=empty, sums=[s.item() for s in sums],
                shape=shape, losses=losses)


def test_init_builds_model_larger_than_cap_and_trains():
    results = run_ranks(_build_and_train, 2, env=ENV, timeout=240)
    for r in results:
        assert r["empty"], "parameters must be empty placeholders after zero.Init"
        assert r["full"] > 100e6  # 27M parameters
        assert r["grown"] < 0.8 * r["full"], r
        assert r["shape"] == (1376, 512)
        assert r["sums"][0] == r["sums"][1], "ranks must start from the same initial values"
        assert all(x == x for x in r["losses"])  # no NaN and r["losses"][-1] < r["losses"][0], r
