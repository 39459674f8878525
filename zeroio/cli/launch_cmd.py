"""`zeroio launch`: run a script on N processes per node, through torch's own launcher.

This is ``torchrun`` with zeroio's defaults and DeepSpeed's launcher flags,
not a new launcher: the arguments are translated into a
``torch.distributed.run`` argument list and handed to its ``run``. Each
process gets the usual ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT`` environment, so a script that calls
``zeroio.initialize`` runs the same under ``zeroio launch``, ``torchrun`` and
``accelerate launch``.

On one node with no ``--master-port`` a free port is picked, so two launches
on one machine do not collide on torchrun's fixed default (29500). Several
nodes meet at ``--master_addr:--master_port`` (torch's static rendezvous,
``--node_rank`` naming this node); zeroio starts one node per command.

DeepSpeed's and torchrun's spellings are accepted as aliases: ``--num_gpus`` /
``--nproc_per_node`` for ``--nproc``, ``--num_nodes`` for ``--nnodes``,
``--master_port``, ``--master_addr``, ``--node_rank`` (underscores or hyphens).
DeepSpeed's other flags (docs/train.md has the table): ``--hostfile``,
``--include`` / ``--exclude`` (launch_hosts.py, launch_plan.py), ``--launcher``
(torch only), ``--bind_cores_to_rank`` / ``--bind_core_list``
(launch_cores.py), ``--no_local_rank`` (by default the script gets
``--local_rank=N`` first, as DeepSpeed's launcher passes it), ``--no_python``,
``--module``. The ranks find zeroio's ``deepspeed`` package first on their
``PYTHONPATH`` (``zeroio.deepspeed.shim_dir()``), so ``import deepspeed`` in the
script is zeroio; a DeepSpeed installation is shadowed only here. With accelerate's
``--config_file`` the ranks are started by accelerate's launcher instead
(launch_accelerate.py).

Each rank is started through ``zeroio.cli.rank``, which makes it die with this
launcher (rank.[Note: ranks die with their launcher]) and applies the per-rank
flags. When a rank fails, the summary line names the rank that failed first:
the one not stopped by the launcher itself (torch's launcher sends SIGTERM to
the survivors of a failure).

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
from dataclasses import dataclass

from zeroio.cli.launch_plan import LaunchPlan
from zeroio.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on N processes (torch.distributed.run)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--nproc", "--num_gpus", "--num-gpus", "--num_accelerators", "--nproc_per_node",
                   "--nproc-per-node", dest="nproc", type=int, default=None,
                   help="processes per node (default: the number of GPUs, or 1 without CUDA)")
    p.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", type=int, default=None,
                   help="number of nodes (default 1, or the hostfile's hosts)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   help="this node's rank (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0 (default 127.0.0.1, or the hostfile's first host)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("-H", "--hostfile", default=None,
                   help="DeepSpeed hostfile ('HOST slots=N' lines); zeroio starts one node per "
                   "command: give --node_rank, or it prints each node's command")
    p.add_argument("-i", "--include", default="",
                   help="DeepSpeed's NAME[:SLOT,...][@NAME...]; localhost:0,1 runs 2 ranks on "
                   "GPUs 0 and 1")
    p.add_argument("-e", "--exclude", default="", help="the slots not to use (same syntax)")
    p.add_argument("--launcher", default=None,
                   help="torch (what zeroio uses); DeepSpeed's pdsh/openmpi/... are refused")
    p.add_argument("--launcher_args", default="", help=argparse.SUPPRESS)
    p.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                   help="pin each rank to its share of the cores (OMP_NUM_THREADS = the share)")
    p.add_argument("--bind_core_list", "--bind-core-list", default=None,
                   help="the cores to share out, e.g. 0-15,32-47 (default: all this launcher "
                   "may use)")
    p.add_argument("--config_file", "--config-file", default=None,
                   help="an accelerate config file: launch through accelerate's launcher with "
                   "zeroio's deepspeed package (launch_accelerate.py)")
    p.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                   help="do not pass --local_rank=N to the script")
    p.add_argument("--no_python", "--no-python", action="store_true",
                   help="execute SCRIPT directly instead of with python")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name, like python -m")
    for flag in ("--no_ssh", "--no_ssh_check", "--force_multi"):  # zeroio never uses ssh
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, (_, takes_value) in _UNSUPPORTED.items():
        p.add_argument(flag, dest=flag.lstrip("-"), default=None, help=argparse.SUPPRESS,
                       **({} if takes_value else {"action": "store_const", "const": True}))
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


_UNSUPPORTED = {
    "--autotuning": ("DeepSpeed's autotuner", True),
    "--elastic_training": ("elastic training", False),
    "--min_elastic_nodes": ("elastic training", True),
    "--max_elastic_nodes": ("elastic training", True),
    "--save_pid": ("the pid file", False),
    "--enable_each_rank_log": ("per-rank log files (redirect the launcher's output instead)",
                               True),
    "--ssh_port": ("ssh (zeroio starts one node per command)", True),
    "--venv_script": ("a per-node environment script (activate it before zeroio launch)", True),
}
"""DeepSpeed launcher flags zeroio does not implement: (what each one is, for the error;
whether it takes a value)."""


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
    rank_options: list[str] | None = None,
) -> list[str]:
    """The ``torch.distributed.run`` argument list for one launch (validated). ``guard``: start
    each rank through ``zeroio.cli.rank`` (it dies with the launcher; see that module), with
    ``rank_options`` (its per-rank options: ``--local-rank-arg``, ``--bind-cores``, ...)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}", key="nproc")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}", key="nnodes")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}",
                          key="node_rank")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise ConfigError(f"--master_port {master_port} is not a TCP port; give one in 1..65535 "
                          "(or drop it: one node picks a free port)", key="master_port")
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
        return argv + ["--module", "zeroio.cli.rank", *(rank_options or []),
                       *(["-m"] if module else []), script, *script_args]
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


def _refuse_unsupported(args) -> None:
    for flag, (what, _) in _UNSUPPORTED.items():
        if getattr(args, flag.lstrip("-"), None) is not None:
            raise ConfigError(f"{flag}: zeroio launch does not implement {what}",
                              key=flag.lstrip("-"))


def _shim_pythonpath() -> None:
    """Put zeroio's ``deepspeed`` package first on the ranks' import path, so ``import
    deepspeed`` in the script is zeroio (zeroio/deepspeed/__init__.py, ``shim_dir``); only
    when that folder holds the package. Outside `zeroio launch` nothing is shadowed."""
    from zeroio.deepspeed import shim_dir

    shim = shim_dir()
    if not (shim / "deepspeed" / "__init__.py").is_file():
        return
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(shim)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(shim), *rest])


def _bind_cores(args, nproc: int) -> tuple[str | None, int | None]:
    """(the core list each rank takes its share of, the share: the ranks' ``OMP_NUM_THREADS``,
    as DeepSpeed sets it) with ``--bind_cores_to_rank``; (None, None) without it."""
    if not args.bind_cores_to_rank:
        if args.bind_core_list:
            raise ConfigError("--bind_core_list needs --bind_cores_to_rank", key="bind_core_list")
        return None, None
    from zeroio.cli.launch_cores import (
        check_on_machine,
        cores_per_rank,
        format_core_list,
        machine_cores,
        parse_core_list,
    )

    cores = (check_on_machine(parse_core_list(args.bind_core_list), args.bind_core_list)
             if args.bind_core_list else machine_cores())
    return format_core_list(cores), cores_per_rank(cores, nproc)


def _script_args(args) -> list[str]:
    return args.script_args[1:] if args.script_args[:1] == ["--"] else list(args.script_args)


def rank_options(args, cores: str | None) -> list[str]:
    """``zeroio.cli.rank``'s options for DeepSpeed's per-rank flags."""
    if args.no_python and args.module:
        raise ConfigError("--no_python and --module cannot be used together (as in DeepSpeed)",
                          key="no_python")
    opts = [] if args.no_local_rank else ["--local-rank-arg"]
    if cores is not None:
        opts += ["--bind-cores", cores]
    return opts + (["--no-python"] if args.no_python else [])


def check_script(args) -> None:
    """The script exists before any rank starts: a file (or a folder with __main__.py, as
    python runs it), or with --no_python a program on PATH. A module (-m) is found by the
    ranks' own import path, so it is not looked up here."""
    import shutil
    from pathlib import Path

    if args.module:
        return
    script = args.script
    if args.no_python:
        if shutil.which(script) is None:
            raise ConfigError(f"script {script}: no such program (--no_python runs it directly: "
                              "give its path or a name on PATH)", key="script")
        return
    path = Path(script)
    if path.is_file() or (path / "__main__.py").is_file():
        return
    why = "is a folder without __main__.py" if path.is_dir() else "does not exist"
    raise ConfigError(f"script {script} {why}; pass the training script (or -m MODULE)",
                      key="script")


@dataclass(frozen=True, kw_only=True)
class CheckedLaunch:
    """What one `zeroio launch` starts, every flag checked (``check_launch``)."""

    plan: LaunchPlan
    threads: int | None
    """The ranks' ``OMP_NUM_THREADS`` (--bind_cores_to_rank), None to leave it."""
    argv: list[str]
    """The ``torch.distributed.run`` arguments."""


def check_launch(args) -> CheckedLaunch:
    """Every check of `zeroio launch`, in one place, before anything is launched or the
    environment is changed: DeepSpeed flags zeroio refuses, the hosts and slots (the plan),
    the script (once the plan says this node runs it), the core list, the per-rank flags, the
    process counts and the port. A mistake is a ConfigError (exit 2) naming the flag."""
    import torch

    from zeroio.cli.launch_plan import plan_launch

    _refuse_unsupported(args)
    if args.master_addr is not None and not args.master_addr.strip():
        raise ConfigError("--master_addr is empty; give node 0's address, or drop the flag "
                          "(127.0.0.1 on one node)", key="master_addr")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = plan_launch(args, gpus=gpus, visible_env=os.environ.get("CUDA_VISIBLE_DEVICES"),
                       default_nproc=default_nproc())
    check_script(args)
    cores, threads = _bind_cores(args, plan.nproc)
    script_args = _script_args(args)
    argv = torchrun_argv(
        args.script, script_args, nproc=plan.nproc, nnodes=plan.nnodes,
        node_rank=plan.node_rank, master_addr=plan.master_addr, master_port=plan.master_port,
        module=args.module, guard=True, rank_options=rank_options(args, cores))
    return CheckedLaunch(plan=plan, threads=threads, argv=argv)


def run(args) -> int:
    if args.config_file is not None:  # launch_accelerate.[Note: accelerate config files ...]
        from zeroio.cli.launch_accelerate import run_accelerate

        check_script(args)
        _shim_pythonpath()
        return run_accelerate(args, _script_args(args))
    job = check_launch(args)
    if job.plan.note:
        print(job.plan.note, file=sys.stderr)
    if job.plan.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(job.plan.visible_devices)
    if job.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(job.threads)
    _shim_pythonpath()
    return launch(job.argv)
