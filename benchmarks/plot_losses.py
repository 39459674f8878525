"""Loss per step of several published rows on one chart (e.g. an inexact mode beside exact AdamW).

    python benchmarks/plot_losses.py benchmarks/results/peers-best-h200/{zeroio-z2-cpu,ds-z2-zenflow}.json \
        --out benchmarks/results/peers-best-h200/losses.png

Each argument is a row JSON of benchmarks/results/ (``numbers.losses``: one loss per
training step, warm-up included). Rows without losses are listed in the legend as such.
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_results import save  # noqa: E402


def curves(docs: list[dict]) -> list[tuple[str, list[float]]]:
    """(row name, losses) per document, in the given order; [] where a row has none."""
    return [(d.get("row") or d.get("label") or "?", list((d.get("numbers") or {}).get("losses")
                                                         or [])) for d in docs]


def plot(docs: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves(docs):
        if losses:
            ax.plot(range(1, len(losses) + 1), losses, marker="o", ms=3, label=name)
        else:
            ax.plot([], [], label=f"{name} (no losses)")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    return save(fig, path)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path, nargs="+", help="row JSONs of benchmarks/results/")
    ap.add_argument("--out", type=Path, required=True, help="PNG path")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    path = plot([json.loads(p.read_text()) for p in args.rows], args.out, args.title)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
