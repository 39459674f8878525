"""`zeroio tune` (placeholder until its issue lands: registers the name only)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="(not implemented yet)")
    p.set_defaults(func=run)


def run(args) -> int:
    raise SystemExit("zeroio tune: not implemented yet")
