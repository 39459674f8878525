"""One tiering policy, built once by the config layer and run by the engine's stores.

An engine built from a JSON config (stage 3, optimizer state and parameters on NVMe, one
spawned gloo rank) resolves its policies once (``resolve_policies``, counted by a wrapper);
each of its tiered stores (the NVMe optimizer's and stage 3's parameter store) runs by that
object's ``tiering`` with only the fields its owner decides replaced (its own folder, its
share of the budgets, its read-ahead), so JSON values reach the stores through it and the
stage-3 settings hold the very object. A JSON without ``tiering.policy`` runs the default
that docs/config.md and docs/tiering.md document (read from the docs' tables, not from the
code), and a store built from keywords gets the same default: one home for it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zeroio.testing import run_ranks

DOCS = Path(__file__).resolve().parents[1] / "docs"
WIDTH = 32
RESERVE, CHUNK = 4096, 12345  # JSON values that are no default, to follow into the stores
#: Fields each store's owner sets itself (the rest must be the config layer's values).
OWNED = {"optimizer": {"gpu_budget_bytes", "cpu_budget_bytes", "prefetch_depth", "nvme_path",
                       "nvme_budget_bytes"},
         "param": {"gpu_budget_bytes", "cpu_budget_bytes", "prefetch_depth", "nvme_path",
                   "pin_memory"}}


def _config(root):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 512, "stage3_param_persistence_threshold": 0,
                "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(root, "o")},
                "offload_param": {"device": "nvme", "nvme_path": os.path.join(root, "p")},
                "tiering": {"nvme_reserve_bytes": RESERVE, "step_chunk_numel": CHUNK,
                            "params_from_master": False}}}


def _body(root):
    import dataclasses

    import torch

    import zeroio
    import zeroio.engine_build as eng

    built = []
    real = eng.resolve_policies

    def counted(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    eng.resolve_policies = counted
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))
        engine, *_ = zeroio.initialize(model=model, config=_config(root))
    finally:
        eng.resolve_policies = real
    tiering = built[0].tiering
    stores = {"optimizer": engine.optimizer.store, "param": engine.partitioner.store.store}
    out = {"built": len(built), "settings_is_built": engine.partitioner.settings.tiering is tiering,
           "config_layer": {"policy": tiering.policy.value,
                            "reserve": tiering.nvme_reserve_bytes,
                            "chunk": tiering.step_chunk_numel}}
    for name, store in stores.items():
        pol = store.cfg
        out[name] = {
            "differs": sorted(f.name for f in dataclasses.fields(pol)
                              if getattr(pol, f.name) != getattr(tiering, f.name)),
            "type_is_the_config_layers": type(pol) is type(tiering),
            "equals_replaced": pol == dataclasses.replace(
                tiering, **{k: getattr(pol, k) for k in OWNED[name]}),
            "policy": store.stats()["policy"], "reserve": pol.nvme_reserve_bytes,
            "chunk": pol.step_chunk_numel}
    engine.close()
    return out


def _documented_default() -> str:
    config_row = re.search(r"^\| `policy` \| [^|]+ \| `(\w+)` \|", (DOCS / "config.md").read_text(),
                           re.M)
    tiering_row = re.search(r'^\| `policy` \| `"(\w+)"` \|', (DOCS / "tiering.md").read_text(),
                            re.M)
    assert config_row and tiering_row, "the policy rows of docs/config.md and docs/tiering.md"
    assert config_row.group(1) == tiering_row.group(1), (config_row.group(0), tiering_row.group(0))
    return config_row.group(1)


def test_engine_stores_run_the_policy_the_config_layer_built(tmp_path):
    res = run_ranks(_body, 1, str(tmp_path))[0]
    assert res["built"] == 1, res  # resolved once per engine
    assert res["settings_is_built"], res  # stage 3's settings hold the very object
    assert res["config_layer"] == {"policy": _documented_default(), "reserve": RESERVE,
                                   "chunk": CHUNK}, res
    for name in ("optimizer", "param"):
        got = res[name]
        assert got["type_is_the_config_layers"] and got["equals_replaced"], (name, got)
        assert set(got["differs"]) <= OWNED[name], (name, got)
        # JSON values reach the store through the object, the unset policy is the documented one
        assert (got["reserve"], got["chunk"]) == (RESERVE, CHUNK), (name, got)
        assert got["policy"] == _documented_default(), (name, got)


def test_keyword_built_store_has_the_documented_default():
    from zeroio.config import load_config
    from zeroio.config.policy import resolve_policies
    from zeroio.tiering import MemoryBackend, TieredStore

    default = _documented_default()
    assert resolve_policies(load_config({}).zero_optimization).tiering.policy.value == default
    with TieredStore(None, backend=MemoryBackend(), cpu_budget_bytes=1 << 16) as store:
        assert store.stats()["policy"] == default
    with TieredStore(None, backend=MemoryBackend(), policy="fifo",
                     cpu_budget_bytes=1 << 16) as store:
        assert store.stats()["policy"] == "fifo"
