"""Assembly of an engine's parts from its config: policies, partitioner, optimizer, tier budgets.

``Engine.__init__`` calls these once, in order: ``resolve_engine_policies`` (config/policy.py),
``engine_placement`` (where every buffer lives: [Note: one placement] in zeroio/placement.py),
``placed_policies`` (its decisions applied to the policies),
``build_partitioner`` (the one place that maps ``zero_optimization.stage`` to a partitioner),
``fit_budgets`` (explicit ``tiering`` budgets split among the stores, [Note: budgets in
training] in tiering/budget.py) and ``build_optimizer`` (the update rule, on the device, the
host or NVMe, or split by ``offload_optimizer.ratio``). ``explicit_budgets`` is what
``engine.stats()`` reports as the budgets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from zeroio.config.policy import resolve_policies
from zeroio.dtypes import DTYPES
from zeroio.errors import ConfigError
from zeroio.optim import cpu_adam
from zeroio.optim.adam import ShardedAdam
from zeroio.optim.factory import OptimizerSpec
from zeroio.optim.rule_build import RankSum, build_rule_optimizer
from zeroio.partition import collectives as comm
from zeroio.partition.stage12 import ShardHome, Stage12Partitioner, host_home
from zeroio.partition.stage12_paged import masters_paging
from zeroio.placement import MachineMemory, Placement, decide_placement


def resolve_engine_policies(cfg, device: torch.device):
    """The offload and tiering policies of ``cfg`` for ``device``, resolved once per engine
    (config/policy.py); the partitioner and optimizer builders take them."""
    return resolve_policies(cfg.zero_optimization,
                            accumulation_steps=cfg.gradient_accumulation_steps, device=device,
                            bf16=cfg.bf16)


def measured_machine(device: torch.device, nvme_path: str | None) -> MachineMemory:
    """This node as ``decide_placement`` takes it: the device's total and free memory (0 on a
    CPU device), the host memory the preflight measures, the free bytes under ``nvme_path``."""
    import shutil
    from pathlib import Path

    from zeroio.config.launch_env import launch_env
    from zeroio.preflight import measure_host_memory
    from zeroio.tiering.device_accum import DEVICE_ROOM

    gpu = int(torch.cuda.get_device_properties(device).total_memory) \
        if device.type == "cuda" else 0
    free = int(DEVICE_ROOM(device) or 0)  # 0 without a device (a test may stand one in)
    host = measure_host_memory()
    disk = 0
    if nvme_path:
        path = Path(nvme_path).absolute()
        while not path.exists() and path != path.parent:  # the folder is made later
            path = path.parent
        disk = int(shutil.disk_usage(path).free)
    world = comm.world_size()
    local = launch_env().local_world_size or world
    per_node = world // max(1, world // max(1, local))  # the preflight's ranks per host
    return MachineMemory(gpu_bytes=gpu, gpu_free_bytes=free, nvme_free_bytes=disk,
                         host_bytes=None if host is None else host.available,
                         gpus_per_node=per_node if world % per_node == 0 else world)


def engine_placement(cfg, module: torch.nn.Module, spec: OptimizerSpec, device: torch.device,
                     policies) -> Placement:
    """The engine's placement ([Note: one placement]): ``decide_placement`` for the
    parameters ``spec`` trains on this world and this measured machine."""
    from zeroio.preflight import largest_group, param_numel

    return decide_placement(num_params=max(1, param_numel(spec)), config=cfg,
                            world_size=comm.world_size(),
                            machine=measured_machine(device, policies.tiering.nvme_path),
                            largest_group=largest_group(module) or None,
                            device_type=device.type, policies=policies,
                            grad_streams=spec.rule == "adam")


def placed_policies(policies, placement: Placement):
    """``policies`` with the placement's decisions applied ([Note: the host floor] in
    zeroio/placement.py): where it dropped the 16-bit parameter shards, ``params_from_master``
    on and the step assist off (it writes those shards)."""
    t = policies.tiering
    if not placement.params_from_master or t.params_from_master:
        return policies
    return dataclasses.replace(policies, tiering=dataclasses.replace(
        t, params_from_master=True, step_assist=False))


def build_partitioner(cfg, module: torch.nn.Module, spec: OptimizerSpec, device: torch.device,
                      policies=None, placement: Placement | None = None):
    """The one place that maps ``zero_optimization.stage`` to a partitioner (``policies``:
    ``resolve_engine_policies``'s, resolved here when not given; ``placement``: the engine's,
    whose decisions the partitioner follows, None: it decides by the same rules)."""
    accum = None if placement is None else placement.accumulation_on_device
    grad_dev = None if placement is None else placement.gradient_on_device
    zc = cfg.zero_optimization
    dtype = DTYPES[cfg.compute_dtype]
    pol = policies if policies is not None else resolve_engine_policies(cfg, device)
    off = pol.optimizer
    if off.device == "none":
        home = ShardHome(device=device)
    else:  # cpu, and nvme (whose masters and moments are swapped by the optimizer)
        home = host_home(pin_memory=off.pin_memory or device.type == "cuda")
    if zc.stage in (0, 1, 2):
        return Stage12Partitioner(
            module=module, param_groups=spec.param_groups, stage=zc.stage, compute_dtype=dtype,
            device=device, home=home, reduce_bucket_numel=max(1, zc.reduce_bucket_size),
            overlap_forward=off.cpu and pol.tiering.overlap_step,
            optimizer_ratio=off.ratio if off.cpu else 1.0,
            cpu_optimizer=off.cpu, nvme_optimizer=off.nvme,
            accumulation_steps=pol.accumulation_steps,
            step_chunk_numel=pol.tiering.step_chunk_numel,
            step_assist=pol.tiering.step_assist, gpu_budget_bytes=pol.tiering.gpu_budget_bytes,
            accumulate_on_device=accum, gradient_on_device=grad_dev,
            host_kernel=cpu_adam if spec.rule == "adam" else None,
            master_dtype=DTYPES[pol.precision.master], state_dtype=DTYPES[pol.precision.states],
            masters=masters_paging(cfg, pol, spec.rule) if off.nvme else None)
    if zc.stage == 3:
        from zeroio.partition.stage3 import build_stage3_partitioner

        return build_stage3_partitioner(cfg=cfg, module=module, spec=spec, device=device,
                                        compute_dtype=dtype, home=home, policies=pol,
                                        host_kernel=cpu_adam if spec.rule == "adam" else None,
                                        accumulate_on_device=accum, gradient_on_device=grad_dev)
    raise ConfigError(f"zero_optimization.stage = {zc.stage}: expected 0, 1, 2 or 3",
                      key="zero_optimization.stage")


def build_optimizer(cfg, partitioner, spec: OptimizerSpec, shares: dict | None = None,
                    policies=None):
    """``shares``: the NVMe optimizer's share of explicit tier budgets (``fit_budgets``);
    ``policies``: as for ``build_partitioner``."""
    policies = policies if policies is not None else resolve_engine_policies(cfg, None)
    if spec.rule != "adam":  # SGD, Adagrad, Lion, Lamb: optim/rule_build.py
        nccl = comm.backend(partitioner.group) == "nccl"
        ranks = RankSum(all_reduce=lambda t: comm.all_reduce(t, partitioner.group).wait(),
                        device=partitioner.device if nccl else torch.device("cpu"))
        return build_rule_optimizer(cfg, partitioner, spec, shares, policies, rank=comm.rank(),
                                    ranks=ranks)
    split = partitioner.optimizer_split
    if split is not None:  # offload_optimizer.ratio < 1: partition/stage3/twin.py, stage12.py
        from zeroio.optim.twin import TwinAdam

        return TwinAdam(device=ShardedAdam(split.device, spec.hyper, decoupled=spec.decoupled),
                        host=_offloaded_optimizer(cfg, split.host, spec, partitioner, shares,
                                                  policies),
                        groups=partitioner.groups, transfers=partitioner.transfers)
    return _offloaded_optimizer(cfg, partitioner.groups, spec, partitioner, shares, policies)


def _offloaded_optimizer(cfg, groups, spec: OptimizerSpec, partitioner, shares, policies):
    if policies.optimizer.device == "nvme":
        from zeroio.optim.swap import SwappedAdam

        return SwappedAdam(groups, spec.hyper, decoupled=spec.decoupled, policies=policies,
                           aio=cfg.aio, grad_divisor=partitioner.host_grad_divisor,
                           rank=comm.rank(), masters=getattr(partitioner, "paged", None),
                           **(shares or {}))
    # stage 1/2's 16-bit host gradients are not averaged yet (stage12.[Note: 16-bit host
    # gradients]): the optimizer (either) folds the divisor into its grad_scale
    return ShardedAdam(groups, spec.hyper, decoupled=spec.decoupled,
                       grad_divisor=partitioner.host_grad_divisor,
                       grad_dtype=partitioner.grad_read_dtype,
                       state_dtype=DTYPES[policies.precision.states],
                       state_gate=partitioner.release_device_state,
                       transfers=partitioner.transfers)


def fit_budgets(cfg, partitioner, held_cpu: int) -> dict:
    """Split explicit ``tiering`` budgets among the state outside stores (``held_cpu`` host
    bytes), stage 3's NVMe parameter store (its share set here) and the NVMe optimizer
    (the returned ``SwappedAdam`` keywords): [Note: budgets in training] in
    tiering/budget.py. CapacityError when the CPU budget cannot hold what must stay."""
    from zeroio.partition.stage3.nvme_store import TieredShards
    from zeroio.tiering.budget import split_host_budget

    zc = cfg.zero_optimization
    opt_nvme = zc.offload_optimizer.device == "nvme"
    pstore = partitioner.store if isinstance(partitioner.store, TieredShards) else None
    shares: dict = {}
    if not (opt_nvme or pstore):
        return shares
    if zc.tiering.cpu_budget_bytes is not None:
        opt_floor = 0
        if opt_nvme:
            from zeroio.optim.swap_plan import min_host_bytes

            split = partitioner.optimizer_split
            states = DTYPES[cfg.bf16.optimizer_state_dtype].itemsize
            paged = getattr(partitioner, "paged", None)  # masters (and gradients) there too
            grads = None if paged is None else paged.grads
            sizes = () if paged is None else (paged.dtype.itemsize, states, states) + (
                () if grads is None else (grads.dtype.itemsize,))
            opt_floor = min_host_bytes(split.host if split is not None else partitioner.groups,
                                       zc.sub_group_size, states, sizes,
                                       piece_elems=None if paged is None else
                                       paged.cut.piece_elems,
                                       landing=0 if grads is None else grads.dtype.itemsize)
        cut = split_host_budget(zc.tiering.cpu_budget_bytes, held=held_cpu,
                                param_floor=pstore.cpu_floor() if pstore else 0,
                                param_ask=pstore.cpu_ask() if pstore else 0,
                                optimizer_floor=opt_floor)
        if pstore is not None:
            pstore.store.shrink_budget("cpu", cut.params)
        shares["cpu_budget_bytes"] = cut.optimizer
    if zc.tiering.nvme_budget_bytes is not None and pstore is not None:
        homes = pstore.store.stats()["tiers"]["nvme"]["home_bytes"]
        pstore.store.shrink_budget("nvme", homes)
        shares["nvme_budget_bytes"] = max(0, zc.tiering.nvme_budget_bytes - homes)
    return shares if opt_nvme else {}


def explicit_budgets(cfg) -> dict[str, int]:
    """The user's tier budgets that bound training state (what ``engine.stats()`` reports
    as ``budget_bytes``): cpu and nvme, when something is offloaded to NVMe."""
    zc = cfg.zero_optimization
    if not (zc.offload_optimizer.device == "nvme" or
            (zc.stage == 3 and zc.offload_param.device == "nvme")):
        return {}
    return {t: b for t, b in (("cpu", zc.tiering.cpu_budget_bytes),
                              ("nvme", zc.tiering.nvme_budget_bytes)) if b is not None}


@contextlib.contextmanager
def swap_cleanup(policies) -> Iterator[list]:
    """[Note: a failed initialize leaves no files]
    Stores that swap to NVMe write files as they are built (stage 3's parameter shards, the
    paged masters, the optimizer's moments). If initialize fails after that (a CapacityError
    of the host budget's split, a full disk, any error), every part built so far is closed
    (the caller appends the partitioner, then the optimizer, to the yielded list): each store
    deletes the files it wrote and the folders its owner made, and the folders of each
    ``nvme_path`` that did not exist before are removed again when empty. nvme_path is left
    as it was."""
    made = [_missing_dirs(p) for p in {policies.optimizer.nvme_path, policies.param.nvme_path}
            if p]
    built: list = []
    try:
        yield built
    except BaseException:
        for part in reversed(built):
            with contextlib.suppress(Exception):  # the first error is the one to report
                part.close()
        from zeroio.io import swapdir

        for missing in made:
            for d in missing:  # innermost first
                swapdir.remove_if_empty(d)
        raise


def _missing_dirs(path: str) -> list[str]:
    """``path`` and its parents that do not exist now, innermost first."""
    out, path = [], os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out
