"""benchmarks/masters_nvme_check.py: each check against hand-made train_llama results.

The two runs are a real pair's shape (benchmarks/train_llama.py's JSON: losses, optimizer_io
per step, peak host RSS, engine.stats()'s placement budgets and swap plan); the verdicts and
the disk floor are computed by hand below.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import masters_nvme_check as mc  # noqa: E402

GIB = 2**30
BUDGET = 12 * GIB
STREAMED = 30 * 10**9


def _run(losses, *, rss_gib=10.0, io=(STREAMED, STREAMED), kinds=("master", "exp_avg",
                                                                   "exp_avg_sq")):
    plan = {"pieces": 100, "resident_pieces": 20, "read_ahead": 3, "cpu_budget_bytes": 9 * GIB,
            "kinds": list(kinds), "streamed_bytes_each_way": STREAMED}
    return {"config": "cfg.json", "warmup": 1, "losses": list(losses), "s_per_step": 20.0,
            "peak_host_rss_gib": rss_gib, "machine": "h", "gpu": "H200", "date": "d",
            "commit": "c", "params": 4_309_815_296,
            # the warm-up step reads everything once (not checked); the timed ones stream
            "optimizer_io": [{"read_bytes": 3 * STREAMED, "write_bytes": STREAMED}] +
            [{"read_bytes": io[0], "write_bytes": io[1]}] * 2,
            "stats": {"placement": {"budgets": {"cpu": BUDGET}},
                      "sources": {"optimizer": {"swap_plan": plan}}}}


def test_a_good_pair_passes_every_check_and_writes_the_table(tmp_path):
    resident, paged = _run([2.5, 2.25, 2.0]), _run([2.5, 2.25, 2.0])
    resident["s_per_step"] = 1.5
    disk = {"raw": {"read_gbps": 3.0, "write_gbps": 2.0}}
    for name, obj in (("r.json", resident), ("p.json", paged), ("d.json", disk)):
        (tmp_path / name).write_text(json.dumps(obj))
    rc = mc.main(["--resident", str(tmp_path / "r.json"), "--paged", str(tmp_path / "p.json"),
                  "--disk", str(tmp_path / "d.json"), "--out", str(tmp_path / "out")])
    assert rc == 0
    result = json.loads((tmp_path / "out" / "masters-nvme.json").read_text())
    assert result["ok"] and all(r["ok"] for r in result["checks"].values())
    # 30 GB read at 3 GB/s and written at 2 GB/s
    assert result["paged_disk_floor_s"] == pytest.approx(10.0 + 15.0)
    assert result["checks"]["host_rss"]["limit_bytes"] == 14 * GIB
    assert result["checks"]["disk_bytes"]["limit_bytes"] == 33 * 10**9
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "| losses | pass |" in readme and "paged disk floor 25.000 s" in readme


@pytest.mark.parametrize("what,paged,failed", [
    ("a loss off by one ulp", _run([2.5, 2.25, 2.0000002]), "losses"),
    ("RSS past budget + 2 GiB", _run([2.5, 2.25, 2.0], rss_gib=14.01), "host_rss"),
    ("a step writing 11% more than the plan", _run([2.5, 2.25, 2.0],
                                                   io=(STREAMED, int(1.11 * STREAMED))),
     "disk_bytes"),
    ("host masters", _run([2.5, 2.25, 2.0], kinds=("exp_avg", "exp_avg_sq")), "paged"),
])
def test_each_check_fails_on_its_own(what, paged, failed):
    result = mc.check(_run([2.5, 2.25, 2.0]), paged)
    assert not result["ok"], what
    assert [k for k, r in result["checks"].items() if not r["ok"]] == [failed], what
    assert result["paged_disk_floor_s"] is None  # no disk rate given


def test_a_run_without_nvme_state_is_named():
    run = _run([1.0])
    run["stats"]["sources"] = {}
    with pytest.raises(SystemExit, match="swap_plan"):
        mc.check(run, run)
