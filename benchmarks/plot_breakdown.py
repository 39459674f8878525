"""Where a zeroio step's time goes, one PNG per benchmark row: a timeline and stacked bars.

    python benchmarks/plot_breakdown.py benchmarks/results/peers-<host>-n1-<stamp>.json
    # -> benchmarks/results/peers-<host>-n1-<stamp>-breakdown-<row>.png per zeroio row
    python benchmarks/plot_breakdown.py benchmarks/results/train_llama-zeroio-<host>-<stamp>.json

Reads the ``breakdown`` a row carries (train_llama.py records ``engine.stats()["breakdown"]``
of its last timed step and the mean over the timed steps; docs/tiering.md, "Step breakdown").
Top: the last timed step on one time axis (seconds from the end of the step before): the
training thread's forward / backward / step with its waits on the host step hatched, the host
step's worker and its CPU Adam chunks, the chunks the GPU stepped for it (step assist); the
dashed line is where the next step began, so a host step running past it overlapped the next
forward. Bottom: the mean timed step as stacked bars (training thread; host step; waits by
reader). Rows without a breakdown (other contenders, older result files) are skipped. Needs
matplotlib (``pip install 'zeroio[bench]'``), imported only when plotting.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green",
          "other": "lightgray", "adam": "tab:purple", "publish": "tab:olive",
          "worker": "silver", "gpu": "tab:red", "wait": "black"}
READERS = ("forward", "backward", "step", "synchronize", "other")


def rows_with_breakdown(doc: dict) -> list[tuple[str, dict]]:
    """(row name, breakdown) of every row that has one: a train_peers / scale_out document's
    rows, or a train_llama result itself."""
    if "rows" in doc:
        return [(r["name"], r["breakdown"]) for r in doc["rows"] if r.get("breakdown")]
    if doc.get("breakdown"):
        return [(doc.get("mode") or "zeroio", doc["breakdown"])]
    return []


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plot_breakdown.py needs matplotlib: pip install 'zeroio[bench]' "
                         f"(or pip install 'matplotlib>=3.7') ({e})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _timeline(ax, rec: dict) -> None:
    lanes = {"training thread": 2, "host worker": 1, "GPU (assist)": 0}
    y = lanes["training thread"]
    for s in rec.get("spans", ()):
        ax.barh(y, s["end"] - s["start"], left=s["start"], color=COLORS[s["name"]],
                label=s["name"], height=0.6)
    for w in rec.get("waits", ()):
        ax.barh(y, w["end"] - w["start"], left=w["start"], height=0.3, fill=False,
                hatch="///", edgecolor=COLORS["wait"], label="waits on host step")
    if rec.get("host_start_s") is not None:
        y = lanes["host worker"]
        ax.barh(y, rec["host_end_s"] - rec["host_start_s"], left=rec["host_start_s"],
                color=COLORS["worker"], height=0.6, label="worker")
    for c in rec.get("chunks", ()):
        cpu = c["device"] == "cpu"
        ax.barh(lanes["host worker" if cpu else "GPU (assist)"], max(c["end"] - c["start"], 1e-6),
                left=c["start"], color=COLORS["adam" if cpu else "gpu"], height=0.4,
                edgecolor="white", linewidth=0.3,
                label="CPU Adam chunk" if cpu else "GPU chunk (assist)")
    ax.axvline(rec["wall_s"], color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_xlabel("seconds from the previous step's end (dashed: this step's end)")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))  # one legend entry per kind
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


def _stack(ax, y: int, parts: list[tuple[str, float, str]], min_label: float) -> None:
    """One stacked bar; segments narrower than ``min_label`` seconds get no text."""
    left = 0.0
    for label, v, color in parts:
        if v > 0:
            ax.barh(y, v, left=left, color=color, height=0.6, label=label)
            if v >= min_label:
                ax.text(left + v / 2, y, f"{label}\n{v:.3g}", ha="center", va="center",
                        fontsize=7)
            left += v


def _bars(ax, rec: dict) -> None:
    rest = rec["host_worker_s"] - rec["host_adam_s"] - rec["host_publish_s"]
    waited = rec.get("waited_s") or {}
    bars = [
        [(k, rec[f"{k}_s"], COLORS[k]) for k in ("forward", "backward", "step", "other")],
        [("adam", rec["host_adam_s"], COLORS["adam"]),
         ("publish", rec["host_publish_s"], COLORS["publish"]),
         ("rest of worker", max(0.0, rest), COLORS["worker"])],
        [(f"waited in {r}", waited.get(r, 0.0), c) for r, c in
         zip(READERS, ("tab:cyan", "tab:brown", "tab:green", "tab:gray", "lightgray"),
             strict=True)],
    ]
    widest = max(sum(max(0.0, v) for _, v, _ in b) for b in bars) or 1.0
    for y, parts in zip((2, 1, 0), bars, strict=True):
        _stack(ax, y, parts, 0.06 * widest)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_yticks([2, 1, 0], ["training thread", "host step worker", "waited, by reader"])
    ax.set_xlabel("seconds (mean over the timed steps)")


def _title(name: str, bd: dict, doc: dict) -> str:
    rec = bd.get("mean") or bd["last"]
    hidden = rec.get("hidden_fraction")
    parts = [name, f"wall {rec['wall_s']:.3f}s/step"]
    if hidden is not None:
        parts.append(f"host step {rec['host_span_s']:.3f}s, {hidden:.0%} hidden")
    parts.append(f"PCIe h2d {rec['h2d_bytes'] / 1e9:.2f} GB, d2h {rec['d2h_bytes'] / 1e9:.2f} GB")
    if rec.get("numel_gpu"):
        share = rec["numel_gpu"] / max(1, rec["numel_gpu"] + rec["numel_cpu"])
        parts.append(f"assist {share:.0%} of elements, {rec['assist_gpu_s']:.3f}s on the GPU")
    commit = ((doc.get("provenance") or {}).get("commit") or doc.get("commit") or "")[:10]
    return " - ".join(parts) + (f" ({commit})" if commit else "")


def plot_row(name: str, bd: dict, path: Path, doc: dict | None = None) -> Path:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6),
                                      gridspec_kw={"height_ratios": [3, 2]})
    _timeline(top, bd["last"])
    top.set_title(f"step {bd['last']['step']} (last timed)", fontsize=9)
    _bars(bottom, bd.get("mean") or bd["last"])
    fig.suptitle(_title(name, bd, doc or {}), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot(doc: dict, json_path: Path, out_dir: Path | None = None) -> list[Path]:
    """One PNG per row with a breakdown, named ``<json stem>-breakdown-<row>.png``."""
    out_dir = out_dir or json_path.parent
    out = []
    for name, bd in rows_with_breakdown(doc):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        out.append(plot_row(name, bd, out_dir / f"{json_path.stem}-breakdown-{safe}.png", doc))
    return out


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a peers-*.json, scale-*.json or train_llama-*.json")
    ap.add_argument("--out", type=Path, help="folder for the PNGs (default: beside the JSON)")
    args = ap.parse_args(argv)
    doc = json.loads(args.results.read_text())
    if not rows_with_breakdown(doc):
        raise SystemExit(f"{args.results}: no row has a step breakdown (zeroio rows recorded "
                         "by benchmarks/train_llama.py carry one)")
    paths = plot(doc, args.results, args.out)
    for p in paths:
        print(f"wrote {p}")
    return paths


if __name__ == "__main__":
    main()
