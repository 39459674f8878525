"""`zeroio train` (placeholder until its issue lands: registers the name only)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="(not implemented yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    raise SystemExit("zeroio train: not implemented yet")
