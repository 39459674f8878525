"""scale_out.py's efficiency table against hand computation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale_out  # noqa: E402


def _row(name, world, tps, status="ok"):
    return {"name": name, "world": world, "tokens_per_s": tps if status == "ok" else None,
            "status": status, "reason": "" if status == "ok" else "x", "s_per_step": 1.0,
            "stall_s_per_step": None, "peak_gpu_gib": None, "peak_host_rss_gib": None}


def test_efficiency_by_hand():
    rows = scale_out.efficiency([
        _row("a", 1, 1000.0), _row("a", 2, 1800.0), _row("a", 4, 3200.0),
        _row("b", 1, 500.0, status="failed"), _row("b", 2, 900.0), _row("b", 8, 3240.0)])
    got = {(r["name"], r["world"]): r for r in rows}
    assert got[("a", 2)]["tokens_per_s_per_gpu"] == 900.0
    assert got[("a", 2)]["eff_vs_1"] == pytest.approx(0.9)
    assert got[("a", 4)]["eff_vs_1"] == pytest.approx(0.8)  # 800 / 1000
    assert got[("a", 4)]["eff_vs_2"] == pytest.approx(800 / 900)
    assert got[("b", 1)]["tokens_per_s_per_gpu"] is None
    assert got[("b", 8)]["eff_vs_1"] is None  # its 1-GPU run failed
    assert got[("b", 8)]["eff_vs_2"] == pytest.approx(405 / 450)
    text = scale_out.table(rows)
    assert "| a | 4 | 1.000 | 3,200 | 800 | 0.80 | 0.89 |" in text
