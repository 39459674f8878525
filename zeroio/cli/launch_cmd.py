"""`zeroio launch`: run a script on N processes per node, through torch's own launcher.

This is ``torchrun`` with zeroio's defaults, not a new launcher: the arguments
are translated into a ``torch.distributed.run`` argument list and handed to
its ``run``. Each process gets the usual ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` environment, so a script that
calls ``zeroio.initialize`` runs the same under ``zeroio launch``, ``torchrun``
and ``accelerate launch``.

On one node with no ``--master-port`` a free port is picked, so two launches
on one machine do not collide on torchrun's fixed default (29500).

DeepSpeed's and torchrun's spellings are accepted as aliases: ``--num_gpus`` /
``--nproc_per_node`` for ``--nproc``, ``--num_nodes`` for ``--nnodes``,
``--master_port``, ``--master_addr``, ``--node_rank`` (underscores or hyphens).

Each rank is started through ``zeroio.cli.rank``, which makes it die with this
launcher (rank.[Note: ranks die with their launcher]). When a rank fails, the
summary line names the rank that failed first: the one not stopped by the
launcher itself (torch's launcher sends SIGTERM to the survivors of a failure).

[Note: a signalled launch] SIGTERM or SIGINT to the launcher (a scheduler's preemption, Ctrl-C)
is forwarded by torch's launcher to every rank, which it then waits for
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, then SIGKILL); torch raises its
``SignalException`` afterwards, which ends here as one line and exit status 128 + the signal
(143, 130), not a traceback. Ranks that stopped on a signal sent to them directly and exited
128 + it (zeroio.preemption) are reported the same way: a stop, not a failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from zeroio.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on N processes (torch.distributed.run)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--nproc", "--num_gpus", "--num-gpus", "--nproc_per_node", "--nproc-per-node",
                   dest="nproc", type=int, default=None,
                   help="processes per node (default: the number of GPUs, or 1 without CUDA)")
    p.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", type=int, default=1,
                   help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's rank (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name, like python -m")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_argv(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    module: bool = False,
    guard: bool = False,
) -> list[str]:
    """The ``torch.distributed.run`` argument list for one launch (validated). ``guard``: start
    each rank through ``zeroio.cli.rank`` (it dies with the launcher; see that module)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}", key="nproc")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}", key="nnodes")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}",
                          key="node_rank")
    if master_port is None:
        if nnodes > 1:
            master_port = 29500  # every node must agree on it, so no random choice
        else:
            from zeroio.cli.ports import free_port

            master_port = free_port()
    argv = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
    ]
    if guard:
        return argv + ["--module", "zeroio.cli.rank", *(["-m"] if module else []), script,
                       *script_args]
    if module:
        argv.append("--module")
    return argv + [script, *script_args]


def root_failure(failures: dict) -> tuple[int, object]:
    """(global rank, failure) of the rank that failed first, from torch's ``ChildFailedError``
    failures (rank -> ProcessFailure with exitcode, timestamp). The launcher sends SIGTERM to
    every survivor of a failure, so ranks ended by SIGTERM are victims unless all of them were;
    among the rest the earliest timestamp, then the lowest rank."""
    term = -int(signal.SIGTERM)
    cands = [r for r, f in failures.items() if f.exitcode != term] or list(failures)
    rank = min(cands, key=lambda r: (getattr(failures[r], "timestamp", 0), r))
    return rank, failures[rank]


def describe_failure(rank: int, failure) -> tuple[str, int]:
    """('rank 1 was killed by signal 9 (SIGKILL)' or 'rank 1 exited with code 3', exit status)."""
    code = failure.exitcode
    if isinstance(code, int) and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"rank {rank} was killed by signal {-code} ({name})", 128 - code
    if isinstance(code, int) and code > 0:
        return f"rank {rank} exited with code {code}", code
    return f"rank {rank} failed (exit status {code})", 1


def signal_stop(failures: dict) -> signal.Signals | None:
    """The signal every failed rank stopped on (exit status 128 + SIGTERM or SIGINT, as
    zeroio.preemption exits), or None when any rank failed otherwise."""
    stops = {f.exitcode - 128 for f in failures.values()
             if isinstance(f.exitcode, int) and f.exitcode - 128 in (signal.SIGTERM, signal.SIGINT)}
    if len(stops) == 1 and all(isinstance(f.exitcode, int) and f.exitcode > 128
                               for f in failures.values()):
        return signal.Signals(stops.pop())
    return None


def launch(argv: list[str]) -> int:
    """Run ``torch.distributed.run`` with ``argv``; the exit status of the job (0 = every rank
    ok; 128 + the signal when a signal stopped it: [Note: a signalled launch])."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    from zeroio.cli.rank import LAUNCHER_ENV

    os.environ[LAUNCHER_ENV] = str(os.getpid())  # torch's launcher runs here: the ranks' parent
    try:
        torch_run(get_args_parser().parse_args(argv))
    except SignalException as e:  # the ranks got the signal too and have ended
        sig = signal.Signals(e.sigval)
        print(f"zeroio launch: stopped by {sig.name}; the ranks were signalled and have "
              "ended", file=sys.stderr)
        return 128 + int(sig)
    except ChildFailedError as e:
        # torchrun has already printed each failed rank's error; only the summary line here
        failures = e.failures  # global rank -> ProcessFailure
        stop = signal_stop(failures)
        if stop is not None:
            print(f"zeroio launch: stopped by {stop.name} (every rank stopped at a step "
                  "boundary)", file=sys.stderr)
            return 128 + int(stop)
        what, status = describe_failure(*root_failure(failures))
        others = len(failures) - 1
        print(f"zeroio launch: {what}" + (f" ({others} other rank(s) also ended)"
                                          if others else ""), file=sys.stderr)
        return status
    return 0


def run(args) -> int:
    nproc = args.nproc if args.nproc is not None else default_nproc()
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return launch(torchrun_argv(
        args.script, script_args, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, module=args.module,
        guard=True,
    ))
