"""plot_results.py: bar data from a results document; the PNG where matplotlib is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import plot_results  # noqa: E402

DOC = {
    "kind": "train_peers",
    "machine": {"gpus": ["NVIDIA H200, 143771 MiB"]},
    "provenance": {"date": "2026-11-29T15:00:00+00:00", "commit": "a" * 40},
    "rows": [
        {"name": "plain", "world": 1, "s_per_step": 0.222, "status": "ok"},
        {"name": "zeroio-z2-cpu", "world": 1, "s_per_step": 0.35, "status": "ok"},
        {"name": "ds-z3-nvme", "world": 1, "s_per_step": None, "status": "failed"},
    ],
}


def test_bars_keep_order_and_failed_rows():
    assert plot_results.bars(DOC) == [("plain", 0.222, "ok"), ("zeroio-z2-cpu", 0.35, "ok"),
                                      ("ds-z3-nvme", None, "failed")]
    scale = dict(DOC, kind="scale_out")
    assert plot_results.bars(scale)[1][0] == "zeroio-z2-cpu x1"


def test_png_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_results.plot(DOC, tmp_path / "p.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
