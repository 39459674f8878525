"""benchmarks/plot_breakdown.py and train_llama.py's ``timed_breakdown`` on a fixture document.

The fixture is three step records built by hand (zeroio.tiering.breakdown.step_record over
hand-made windows and host records), the way train_llama.py stores them in a train_peers row.
Checked: the mean over the timed steps against a hand average; one PNG per row with a
breakdown (real PNG bytes, readable back as an image), none for rows without one; a clear
message without matplotlib; older documents (no breakdown anywhere) still load as rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH / "peers"))
sys.path.insert(0, str(BENCH))


def _record(step: int, wall: float):
    from zeroio.tiering.breakdown import HostRecord, _Window, step_record

    s = 100.0 * step  # each window on its own stretch of the host clock
    w = _Window(step=step, start=s, end=s + wall, anchor=None,
                moved={"cpu->gpu": 1000 * step, "gpu->cpu": 2000 * step},
                spans=[("forward", s + 0.0, s + 0.3, None, None),
                       ("backward", s + 0.3, s + 0.7, None, None),
                       ("step", s + 0.7, s + 0.8, None, None)])
    host = HostRecord(phases={"worker": 0.5, "adam": 0.4, "publish": 0.05},
                      worker=(s + 0.75, s + 1.25))
    host.add_chunk(s + 0.75, s + 1.0, 60, "cpu")
    host.add_chunk(s + 1.0, s + 1.2, 40, "cpu")
    host.add_wait("forward", s + 1.0, s + 1.25)
    return step_record(w, host)


@pytest.fixture
def doc():
    import train_llama

    from zeroio.tiering.breakdown import compact

    recs = [_record(k, wall) for k, wall in ((1, 2.0), (2, 1.0), (3, 1.2))]
    bd = {"last": recs[-1], "recent": [compact(r) for r in recs], "steps": 3}
    zeroio_row = {"name": "zeroio-z2-cpu", "status": "ok",
                  "breakdown": train_llama.timed_breakdown(bd, warmup=1)}
    return {"kind": "train_peers", "provenance": {"commit": "0123456789abcdef"},
            "rows": [{"name": "plain", "status": "ok", "breakdown": None}, zeroio_row]}


def test_timed_breakdown_is_the_mean_of_the_timed_steps(doc):
    tb = doc["rows"][1]["breakdown"]
    assert tb["steps"] == [2, 3]  # step 1 is warm-up
    assert tb["last"]["step"] == 3 and tb["last"]["chunks"]  # the full record of the last
    mean = tb["mean"]
    assert mean["wall_s"] == pytest.approx((1.0 + 1.2) / 2)
    assert mean["other_s"] == pytest.approx(((1.0 - 0.8) + (1.2 - 0.8)) / 2)
    assert mean["h2d_bytes"] == pytest.approx((2000 + 3000) / 2)
    assert mean["waited_s"]["forward"] == pytest.approx(0.25)
    assert mean["hidden_fraction"] == pytest.approx((0.5 - 0.25) / 0.5)
    assert "chunks" not in mean and "spans" not in mean


def test_one_png_per_row_with_a_breakdown(doc, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import plot_breakdown

    path = tmp_path / "peers-x-n1-1.json"
    path.write_text(json.dumps(doc))
    out = plot_breakdown.main([str(path)])
    assert out == [tmp_path / "peers-x-n1-1-breakdown-zeroio-z2-cpu.png"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [out[0].name]
    assert out[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w, _ = matplotlib.image.imread(out[0]).shape
    assert h > 300 and w > 600
    # a train_llama result file holds the breakdown at the top
    single = tmp_path / "train_llama-zeroio-x.json"
    single.write_text(json.dumps({"mode": "zeroio", "breakdown": doc["rows"][1]["breakdown"]}))
    assert [p.name for p in plot_breakdown.main([str(single)])] == [
        "train_llama-zeroio-x-breakdown-zeroio.png"]


def test_without_matplotlib_the_message_says_what_to_install(doc, tmp_path, monkeypatch):
    import plot_breakdown

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"needs matplotlib: pip install 'zeroio\[bench\]'"):
        plot_breakdown.plot(doc, tmp_path / "peers.json")
    assert not list(tmp_path.glob("*.png"))


def test_documents_without_breakdowns(tmp_path):
    import plot_breakdown
    import report

    old = {"name": "zeroio-z2-cpu", "label": "z2", "status": "ok", "s_per_step": 1.0}
    assert report.Row(**old).breakdown is None  # an older row still loads
    doc = {"kind": "train_peers", "rows": [old]}
    assert plot_breakdown.rows_with_breakdown(doc) == []
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="no row has a step breakdown"):
        plot_breakdown.main([str(path)])


def test_loss_curves_follow_the_row_files(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plot_losses

    docs = [{"row": "a", "numbers": {"losses": [3.0, 2.5, 2.0]}}, {"row": "b", "numbers": {}}]
    assert plot_losses.curves(docs) == [("a", [3.0, 2.5, 2.0]), ("b", [])]
    pytest.importorskip("matplotlib")
    out = plot_losses.plot(docs, tmp_path / "l.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
