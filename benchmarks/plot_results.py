"""Bar chart of s/step per contender from a train_peers.py (or scale_out.py) results JSON.

    python benchmarks/plot_results.py benchmarks/results/peers-<host>-n1-<stamp>.json
    # -> benchmarks/results/peers-<host>-n1-<stamp>.png

Rows that did not train are drawn as an empty slot labelled with their
status, so a failing contender stays visible. Needs matplotlib (present on
the GPU machine; not a zeroio dependency).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def bars(doc: dict) -> list[tuple[str, float | None, str]]:
    """(label, s/step or None, status) per row, in the table's order."""
    out = []
    for r in doc["rows"]:
        label = r["name"] if doc.get("kind") != "scale_out" else f"{r['name']} x{r['world']}"
        out.append((label, r["s_per_step"] if r["status"] == "ok" else None, r["status"]))
    return out


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = bars(doc)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(data)), 4))
    xs = range(len(data))
    heights = [v or 0.0 for _, v, _ in data]
    colors = ["tab:green" if lbl.startswith("zeroio") else "tab:gray" for lbl, _, _ in data]
    ax.bar(xs, heights, color=colors)
    top = max(heights, default=1.0) or 1.0
    for x, (_, v, status) in zip(xs, data, strict=True):
        ax.text(x, (v or 0) + 0.01 * top, f"{v:.3f}" if v is not None else status,
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [lbl for lbl, _, _ in data], rotation=30, ha="right")
    ax.set_ylabel("s/step (median after warm-up; lower is better)")
    m, p = doc["machine"], doc["provenance"]
    ax.set_title(f"{', '.join(m.get('gpus') or ['CPU'])} - {p['date'][:10]} - {p['commit'][:10]}",
                 fontsize=9)
    return save(fig, path)


def save(fig, path: Path) -> Path:
    """Lay out, write and close a figure (the plotting scripts' common ending)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a peers-*.json or scale-*.json")
    ap.add_argument("--out", type=Path, help="PNG path (default: beside the JSON)")
    args = ap.parse_args(argv)
    doc = json.loads(args.results.read_text())
    path = plot(doc, args.out or args.results.with_suffix(".png"))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
