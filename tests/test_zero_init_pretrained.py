"""``from_pretrained`` under ``zero.Init`` on 2 gloo ranks: partitioned straight from the file.

Checkpoints are tiny ``LlamaForCausalLM`` folders written by ``save_pretrained``: one
safetensors file (fp32, untied), a sharded folder with an index (small
``max_shard_size``, tied embeddings) and a bf16 one. The reference is a plain
``from_pretrained`` of the same folder in the same rank process. Each case checks:
- every parameter is an empty placeholder whose kept shard has ceil(numel/2) elements;
- nothing read a whole tensor: zeroio's reader never read more bytes at once than one
  shard, its total is the shards' sizes, and transformers' own ``safe_open`` was not
  called while loading under zero.Init;
- ``GatheredParameters`` shows exactly (bit for bit) the reference's parameters, the tied
  parameter object is shared as in the reference, buffers (rotary ``inv_freq``) are equal,
  and the missing/unexpected/mismatched report equals the reference's.
A checkpoint missing a key and holding an extra one checks the report and that the
missing weight gets transformers' init (bit-identical to the reference from the same seed).
Training: a partitioned load trained by ``zeroio.initialize`` matches plain-PyTorch AdamW
on the plainly loaded model (fp32 tolerance of test_stage3_equivalence).
"""

from __future__ import annotations

import pytest

from zeroio.testing import run_ranks

SEED_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def _llama_config(tied: bool, dtype: str = "float32"):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                       max_position_embeddings=64, tie_word_embeddings=tied, use_cache=False,
                       dtype=dtype)


def _save(path, *, tied: bool, dtype: str = "float32", **kw) -> str:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(_llama_config(tied))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(path), **kw)
    return str(path)


class _CountSafeOpen:
    """Counts transformers' own safetensors opens (its loader's way into the file)."""

    def __init__(self):
        import transformers.modeling_utils as mu

        self.mu, self.orig, self.calls = mu, mu.safe_open, 0

    def __enter__(self):
        def counting(*a, **k):
            self.calls += 1
            return self.orig(*a, **k)

        self.mu.safe_open = counting
        return self

    def __exit__(self, *exc):
        self.mu.safe_open = self.orig


def _info(info: dict) -> dict:
    return {k: sorted(map(str, info[k])) for k in ("missing_keys", "unexpected_keys",
                                                   "mismatched_keys")}


def _load_and_compare(folder: str, seed: int = 11) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import zeroio
    from zeroio.partition.stage3 import registry

    torch.manual_seed(seed)
    ref, ref_info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    init = zeroio.zero.Init(config=SEED_AUTO)
    torch.manual_seed(seed)
    with _CountSafeOpen() as opens, init:
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    named = dict(model.named_parameters())
    shards = {n: registry.INIT_SHARDS[p] for n, p in named.items()}
    sizes = {n: (p.numel(), s.shard.numel(), s.numel) for n, (p, s) in
             zip(named, zip(named.values(), shards.values(), strict=True), strict=True)}
    shard_bytes = {n: s.shard.numel() * s.shard.element_size() for n, s in shards.items()}
    with zeroio.zero.GatheredParameters(list(named.values())):
        full = {n: p.detach().cpu().clone() for n, p in named.items()}  # CUDA shards too
    refp = dict(ref.named_parameters())
    stats = init.last_read_stats
    return dict(
        sizes=sizes, safe_open_calls=opens.calls,
        largest_read=stats.largest_read_bytes, bytes_read=stats.bytes_read,
        largest_shard=max(shard_bytes.values()), loaded_bytes=sum(shard_bytes.values()),
        largest_param=max(p.numel() * p.element_size() for p in refp.values()),
        names=sorted(full) == sorted(refp),
        unequal=[n for n in refp if not (full[n].dtype == refp[n].dtype
                                         and torch.equal(full[n], refp[n]))],
        dtypes=sorted({str(t.dtype) for t in full.values()}),
        tied=(model.lm_head.weight is model.model.embed_tokens.weight,
              ref.lm_head.weight is ref.model.embed_tokens.weight),
        buffers=all(torch.equal(b.cpu(), dict(ref.named_buffers())[n])
                    for n, b in model.named_buffers()),
        info=(_info(info), _info(ref_info)),
        buckets=(init.config.zero_optimization.reduce_bucket_size,
                 init.config.zero_optimization.stage3_prefetch_bucket_size,
                 init.config.zero_optimization.stage3_param_persistence_threshold),
    )


def _check_partitioned(r: dict) -> None:
    for name, (placeholder, kept, numel) in r["sizes"].items():
        assert placeholder == 0, name
        assert kept == -(-numel // 2), (name, kept, numel)
    assert r["safe_open_calls"] == 0, "transformers read the weights itself"
    assert r["largest_read"] <= r["largest_shard"] < r["largest_param"]
    assert r["bytes_read"] <= r["loaded_bytes"]  # the padding of the last rank is not read
    assert r["names"] and not r["unequal"], r["unequal"]
    assert r["tied"][0] is r["tied"][1]
    assert r["buffers"]
    assert r["info"][0] == r["info"][1]
    assert r["buckets"] == (64 * 64, int(0.9 * 64 * 64), 10 * 64)


def _edited_checkpoint(tmp_path) -> str:
    """A saved folder with one weight removed and one unknown tensor added."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = _save(tmp_path / "edited", tied=False)
    path = f"{folder}/model.safetensors"
    sd = load_file(path)
    del sd["model.layers.1.mlp.down_proj.weight"]
    sd["model.layers.0.extra.weight"] = torch.ones(3)
    save_file(sd, path, metadata={"format": "pt"})
    return folder


def _fallback(folder: str) -> dict:
    """A ``state_dict`` argument: transformers' own loader sets full tensors, zero.Init
    partitions them as they are created."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import zeroio
    from zeroio.partition.stage3 import registry

    sd = load_file(f"{folder}/model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(folder)
    with zeroio.zero.Init(config=SEED_AUTO):
        model = type(ref).from_pretrained(None, config=AutoConfig.from_pretrained(folder),
                                          state_dict=sd)
    named = dict(model.named_parameters())
    kept = {n: (p.numel(), registry.INIT_SHARDS[p].shard.numel()) for n, p in named.items()}
    with zeroio.zero.GatheredParameters(list(named.values())):
        unequal = [n for n, p in ref.named_parameters() if not torch.equal(named[n], p)]
    return dict(kept=kept, numel={n: p.numel() for n, p in ref.named_parameters()},
                unequal=unequal)


def _train(folder: str, steps: int) -> dict:

    from transformers import AutoModelForCausalLM

    import zeroio
    from zeroio.testing.models import lm_loss, stage3_config, token_batches
    from zeroio.testing.reference import adamw_reference
    from zeroio.testing.training import gathered_params, train_steps

    lr, clip = 1e-3, 0.05
    import torch.distributed as dist

    # one batch (the loss falls), rows for every rank of this world
    batches = token_batches(dist.get_world_size(), steps=1, gas=1, micro=2) * steps
    plain = AutoModelForCausalLM.from_pretrained(folder).train()
    ref_losses, ref_params = adamw_reference(plain, batches, lm_loss, lr=lr,
                                             weight_decay=0.01, clip=clip)
    cfg = stage3_config(micro=2, gas=1, clip=clip, lr=lr, zero={
        "stage3_param_persistence_threshold": 0, "sub_group_size": 3000,
        "stage3_prefetch_bucket_size": 6000})
    with zeroio.zero.Init(config=SEED_AUTO):
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    losses = train_steps(engine, batches, device=engine.device)
    got = gathered_params(engine)
    return dict(losses=losses, ref=ref_losses,
                diff=max((got[n] - p.float()).abs().max().item() for n, p in ref_params.items()))


def _all(folders: dict) -> dict:
    out = {k: _load_and_compare(folders[k]) for k in ("single", "sharded", "bf16", "edited")}
    out["fallback"] = _fallback(folders["single"])
    out["train"] = _train(folders["tiny"], 4)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One 2-rank run for every case below (a rank's start-up is most of its time)."""
    import torch

    from zeroio.testing.models import tiny_llama

    tmp = tmp_path_factory.mktemp("pretrained")
    folders = {"single": _save(tmp / "single", tied=False),
               "sharded": _save(tmp / "sharded", tied=True, max_shard_size="20KB"),
               "bf16": _save(tmp / "bf16", tied=False, dtype="bfloat16"),
               "edited": _edited_checkpoint(tmp)}
    torch.manual_seed(0)
    folders["tiny"] = str(tmp / "tiny")
    tiny_llama(checkpointing=False).save_pretrained(folders["tiny"])
    from zeroio.io.safetensors_reader import INDEX_NAME

    assert (tmp / "sharded" / INDEX_NAME).is_file()  # really sharded
    return run_ranks(_all, 2, folders, timeout=400)


@pytest.mark.parametrize("case", ["single", "sharded", "bf16"])
def test_partitioned_from_pretrained_holds_shards_and_gathers_exactly(ranks, case):
    for r in ranks:
        _check_partitioned(r[case])
        want = ["torch.bfloat16"] if case == "bf16" else ["torch.float32"]
        assert r[case]["dtypes"] == want
        assert r[case]["tied"] == ((True, True) if case == "sharded" else (False, False))


def test_missing_and_unexpected_keys_as_transformers(ranks):
    for r in (x["edited"] for x in ranks):
        missing, unexpected, _ = r["info"][0].values()
        assert missing == ["model.layers.1.mlp.down_proj.weight"], r["info"]
        assert unexpected == ["model.layers.0.extra.weight"], r["info"]
        assert r["info"][0] == r["info"][1]
        assert not r["unequal"], r["unequal"]  # the missing weight: HF's init, same seed
        assert all(p == 0 and k == -(-n // 2) for p, k, n in r["sizes"].values())


def test_state_dict_argument_still_partitioned(ranks):
    for r in (x["fallback"] for x in ranks):
        assert not r["unequal"], r["unequal"]
        for name, (placeholder, kept) in r["kept"].items():
            assert placeholder == 0 and kept == -(-r["numel"][name] // 2), name


def test_partitioned_from_pretrained_trains_like_plain_pytorch(ranks):
    for r in (x["train"] for x in ranks):
        assert r["losses"] == pytest.approx(r["ref"], rel=2e-5), (r["losses"], r["ref"])
        assert r["diff"] < 2e-5, r["diff"]
        assert r["losses"][-1] < r["losses"][0]


def _gpu_all(folders: dict) -> dict:
    from zeroio.testing.cuda import exact_cuda_device

    exact_cuda_device()
    out = {k: _load_and_compare(folders[k]) for k in ("single", "sharded")}
    out["train"] = _train(folders["tiny"], 4)
    return out


@pytest.mark.gpu
def test_partitioned_from_pretrained_on_one_gpu(tmp_path):
    """The CUDA path: shards placed on the GPU, NCCL for the missing-key broadcast; gathers
    bit for bit and trains like plain PyTorch (GPU summation order: fp32 tolerance 1e-4)."""
    import torch

    from zeroio.testing.cuda import need_cuda
    from zeroio.testing.models import tiny_llama

    need_cuda(1)
    folders = {"single": _save(tmp_path / "single", tied=False),
               "sharded": _save(tmp_path / "sharded", tied=True, max_shard_size="20KB")}
    torch.manual_seed(0)
    folders["tiny"] = str(tmp_path / "tiny")
    tiny_llama(checkpointing=False).save_pretrained(folders["tiny"])
    r = run_ranks(_gpu_all, 1, folders, backend="nccl", timeout=300)[0]
    for case in ("single", "sharded"):
        assert r[case]["safe_open_calls"] == 0
        assert r[case]["names"] and not r[case]["unequal"], r[case]["unequal"]
        assert r[case]["info"][0] == r[case]["info"][1]
    t = r["train"]
    assert t["losses"] == pytest.approx(t["ref"], rel=1e-4), (t["losses"], t["ref"])
    assert t["diff"] < 1e-4 and t["losses"][-1] < t["losses"][0]
