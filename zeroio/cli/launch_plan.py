"""What one `zeroio launch` starts on this node, from DeepSpeed's launcher flags.

zeroio starts the ranks of one node per command, through torch's elastic
launcher (a static rendezvous at ``--master_addr:--master_port``); it never
logs into other hosts. So a hostfile of several hosts either names this node
(``--node_rank``) or is answered with the command to run on each node
(``PerNodeCommands``, a ConfigError whose message lists them).

Precedence, as in DeepSpeed's runner: ``--include`` / ``--exclude`` choose hosts
and slots and cannot be combined with ``--num_gpus`` / ``--num_nodes``; with a
hostfile, ``--num_nodes N`` keeps its first N hosts and ``--num_gpus G`` the first
G slots of each; without one the pool is this machine (launch_hosts.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from zeroio.cli.launch_hosts import Pool, filter_pool, local_pool, read_hostfile
from zeroio.errors import ConfigError

LAUNCHERS_OK = ("torch", "pytorch")
"""``--launcher`` values that name what zeroio does (torch's elastic launcher)."""


class PerNodeCommands(ConfigError):
    """A hostfile of several hosts without ``--node_rank``: the message lists the command
    to run on each node."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    nproc: int
    """Ranks on this node."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """None: a free port on one node, 29500 on several (torchrun_argv)."""
    visible_devices: list[str] | None = None
    """``CUDA_VISIBLE_DEVICES`` for the ranks (the chosen GPU ids), None to leave it."""
    note: str | None = None
    """One line to print before starting (e.g. slots that are CPU processes)."""


def _addr(args, default: str) -> str:
    """--master_addr, or ``default`` when it is not given (an empty one is refused earlier)."""
    return default if args.master_addr is None else args.master_addr


def check_launcher(name: str | None, launcher_args: str = "") -> None:
    """``--launcher``: torch's is what zeroio uses; DeepSpeed's multi-node backends are not."""
    if name is not None and name.lower() not in LAUNCHERS_OK:
        raise ConfigError(
            f"--launcher {name}: zeroio launch starts each node's ranks itself through torch's "
            "elastic launcher (--launcher torch); it does not drive pdsh, OpenMPI, MVAPICH, "
            "MPICH, IMPI or SLURM. Run `zeroio launch --num_nodes N --node_rank R "
            "--master_addr HOST ...` on each node (by hand, or e.g. from srun)", key="launcher")
    if launcher_args:
        raise ConfigError(f"--launcher_args {launcher_args!r}: zeroio uses no external launcher "
                          "to pass them to", key="launcher_args")


def _visible(slots: list[int], gpus: int, visible_env: str | None) -> list[str] | None:
    """The device ids for ``slots`` (slot i is the i-th GPU this launcher sees)."""
    if gpus == 0:
        return None
    seen = [v.strip() for v in visible_env.split(",")] if visible_env else None
    return [seen[s] if seen else str(s) for s in slots]


def _local(args, gpus: int, visible_env: str | None, default_nproc: int) -> LaunchPlan:
    include, exclude = args.include or "", args.exclude or ""
    if not include and not exclude:
        return LaunchPlan(
            nproc=args.nproc if args.nproc is not None else default_nproc,
            nnodes=args.nnodes if args.nnodes is not None else 1,
            node_rank=args.node_rank if args.node_rank is not None else 0,
            master_addr=_addr(args, "127.0.0.1"), master_port=args.master_port)
    pool = local_pool(gpus, include)
    try:
        slots = filter_pool(pool, include, exclude).get("localhost", [])
    except ConfigError as e:
        raise ConfigError(f"{e} (without --hostfile the pool is this machine, 'localhost')",
                          key=e.key) from None
    if not slots:
        raise ConfigError(f"--exclude {exclude!r} leaves no slot on localhost", key="exclude")
    note = None if gpus else (f"zeroio launch: no CUDA on this machine: slots {slots} run as "
                              f"{len(slots)} CPU rank(s) (gloo)")
    return LaunchPlan(nproc=len(slots), master_addr=_addr(args, "127.0.0.1"),
                      master_port=args.master_port, visible_devices=_visible(slots, gpus,
                                                                             visible_env),
                      note=note)


def _hostfile_pool(args) -> Pool:
    pool = {h: list(range(n)) for h, n in read_hostfile(args.hostfile).items()}
    pool = filter_pool(pool, args.include or "", args.exclude or "")
    if not pool:
        raise ConfigError("--include/--exclude leave no host of the hostfile", key="include")
    hosts = list(pool)
    if args.nnodes is not None:
        if not 1 <= args.nnodes <= len(hosts):
            raise ConfigError(f"--num_nodes {args.nnodes}: the hostfile has {len(hosts)} "
                              "host(s) left", key="num_nodes")
        hosts = hosts[:args.nnodes]
    if args.nproc is not None:
        return {h: pool[h][:args.nproc] for h in hosts}
    return {h: pool[h] for h in hosts}


def node_command(args, *, nnodes: int, node_rank: int, nproc: int, master_addr: str,
                 master_port: int, visible: list[str] | None) -> str:
    """The `zeroio launch` command line that starts node ``node_rank``'s part of the job."""
    argv = ["zeroio", "launch", "--num_nodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc", str(nproc), "--master_addr", master_addr, "--master_port",
            str(master_port)]
    for flag in ("no_local_rank", "no_python", "module", "bind_cores_to_rank"):
        if getattr(args, flag, False):
            argv.append(f"--{flag}")
    if getattr(args, "bind_core_list", None):
        argv += ["--bind_core_list", args.bind_core_list]
    argv += [args.script, *args.script_args]
    env = f"CUDA_VISIBLE_DEVICES={','.join(visible)} " if visible else ""
    return env + shlex.join(argv)


def _several(args, pool: Pool, gpus: int, visible_env: str | None) -> LaunchPlan:
    hosts = list(pool)
    addr = _addr(args, hosts[0])
    port = args.master_port if args.master_port is not None else 29500
    if args.node_rank is None:
        lines = [f"  on {h}: " + node_command(
            args, nnodes=len(hosts), node_rank=i, nproc=len(pool[h]), master_addr=addr,
            master_port=port, visible=[str(s) for s in pool[h]]
            if pool[h] != list(range(len(pool[h]))) else None) for i, h in enumerate(hosts)]
        raise PerNodeCommands(
            f"the hostfile gives {len(hosts)} nodes ({', '.join(hosts)}); zeroio launch starts "
            "the ranks of one node per command and does not log into other hosts. Run on each "
            "node:\n" + "\n".join(lines) + "\nor run this command on each node with "
            "--node_rank N added", key="node_rank")
    if not 0 <= args.node_rank < len(hosts):
        raise ConfigError(f"--node_rank {args.node_rank} must be in 0..{len(hosts) - 1} for the "
                          f"{len(hosts)} hosts of the hostfile", key="node_rank")
    slots = pool[hosts[args.node_rank]]
    return LaunchPlan(nproc=len(slots), nnodes=len(hosts), node_rank=args.node_rank,
                      master_addr=addr, master_port=port,
                      visible_devices=_visible(slots, gpus, visible_env))


def plan_launch(args, *, gpus: int, visible_env: str | None = None,
                default_nproc: int = 1) -> LaunchPlan:
    """This node's part of the job. ``gpus``: GPUs this launcher sees (0 without CUDA);
    ``visible_env``: ``CUDA_VISIBLE_DEVICES`` as set; ``default_nproc``: ranks when nothing
    says how many."""
    check_launcher(getattr(args, "launcher", None), getattr(args, "launcher_args", "") or "")
    if (args.include or args.exclude) and (args.nproc is not None or args.nnodes is not None):
        raise ConfigError("--include/--exclude choose the hosts and GPUs; --num_gpus/--nproc and "
                          "--num_nodes cannot be given with them (as in DeepSpeed)",
                          key="include")
    if not args.hostfile:
        return _local(args, gpus, visible_env, default_nproc)
    pool = _hostfile_pool(args)
    if len(pool) > 1:
        return _several(args, pool, gpus, visible_env)
    (host, slots), = pool.items()
    full = slots == list(range(len(slots)))
    return LaunchPlan(nproc=len(slots), master_addr=_addr(args, "127.0.0.1"),
                      master_port=args.master_port,
                      visible_devices=None if full else _visible(slots, gpus, visible_env))


__all__ = ["LAUNCHERS_OK", "LaunchPlan", "PerNodeCommands", "check_launcher", "node_command",
           "plan_launch"]
