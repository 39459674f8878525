"""Entry point of the ``zeroio`` command.

Each subcommand lives in its own module of this package and exposes
``add_parser(subparsers)``, which registers its parser and sets
``func=run`` through ``set_defaults``. Exit status: 0 done, 1 a failure
(zeroio.ZeroIOError), 2 bad arguments or config (argparse's usage errors and
zeroio.ConfigError alike). Modules are imported only when the
command line is parsed, so ``zeroio --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand module, one-line help); order is the order shown by --help.
COMMANDS = [
    ("train", "train a decoder-only language model end to end"),
    ("launch", "run a script on N processes (torch.distributed.run)"),
    ("bench", "benchmarks: `zeroio bench io`"),
    ("tune", "tuning sweeps: `zeroio tune io`"),
    ("estimate", "memory per GPU, CPU and NVMe for a model and config"),
    ("report", "versions, GPUs, memory limits and kernels of this machine (like ds_report)"),
    ("consolidate", "write a checkpoint as a safetensors folder"),
    ("inspect", "list what a checkpoint holds"),
]


def build_parser() -> argparse.ArgumentParser:
    from zeroio import __version__

    parser = argparse.ArgumentParser(
        prog="zeroio",
        description="Train models whose state is larger than the GPUs: ZeRO 1/2/3 with GPU, "
        "pinned-CPU and NVMe tiers. `zeroio COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"zeroio {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, _help in COMMANDS:
        module = importlib.import_module(f"zeroio.cli.{name}_cmd")
        module.add_parser(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` names: ``zeroio launch`` -> launch's, ``zeroio
    bench io`` -> bench io's; ``parser`` itself when no command was given."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            return command_parser(chosen, args) if chosen is not None else parser
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    own = command_parser(parser, args)
    if extra:  # the usage of the command that was given, not the top level's
        own.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None) or own._subparsers is not None:
        own.print_help(sys.stderr)  # no command, or one that needs its subcommand (bench io)
        return 2
    from zeroio.errors import ConfigError, ZeroIOError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # bad arguments or config, like argparse's usage errors
        print(f"zeroio {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ZeroIOError as e:
        print(f"zeroio {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
