"""The estimate's NVMe host rows under an explicit ``tiering.cpu_budget_bytes`` (estimate.py
module doc, 2.): the stage-3 parameter store's share, then the NVMe optimizer's window and
resident head, split by the engine's own rules (config/host_split.py, shard/swap_rule.py) so the
estimate, the preflight and the engine count the same host bytes. Rows are built with the
estimate's ``make`` (``MemoryItem``) and read by their ``name``, ``tier`` and
``bytes_per_gpu``; torch is not imported.
"""

from __future__ import annotations

from collections.abc import Callable

from zeroio.config import ZeroConfig, host_split

LANDING = "gradient landing pieces (pinned)"


def piece_elems(zero: ZeroConfig, shard: int, element: float) -> int:
    """Elements of the NVMe optimizer's swap piece under ``tiering.cpu_budget_bytes``
    (shard/swap_rule.py; ``element``: the window's bytes per element of each of two tensors)."""
    from zeroio.shard.swap_rule import piece_elems_for, read_ahead

    ahead = read_ahead(zero.tiering.prefetch_depth, bool(zero.offload_optimizer.pipeline_read))
    return max(1, min(shard, zero.sub_group_size, piece_elems_for(
        zero.tiering.cpu_budget_bytes, itemsize=element, ahead=ahead)))


def param_share(items: list, zero: ZeroConfig, *, shard: int, element: float, grad: int,
                resident: int, largest: int, make: Callable) -> list:
    """The stage-3 NVMe parameter store's swap buffers under ``tiering.cpu_budget_bytes``:
    what it asks as far as the optimizer keeps its floor (config/host_split.py, the engine's
    rule); ``element``: the window's bytes per element, ``grad``: a paged gradient's."""
    name = "parameter swap buffers (pinned)"
    row = next((i for i in items if i.name == name), None)
    swapped = sum(i.bytes_per_gpu for i in items if i.name == "parameters" and i.tier == "nvme")
    budget = zero.tiering.cpu_budget_bytes
    if row is None or not swapped:
        return items
    held = sum(i.bytes_per_gpu for i in items if i.tier == "cpu" and i.name not in (
        name, "optimizer swap buffers (pinned)", LANDING) and "max_in_cpu" not in i.name)
    floor = host_split.optimizer_floor(
        shard_elems=shard, piece_elems=piece_elems(zero, shard, element),
        sub_group_size=zero.sub_group_size, element_bytes=int(2 * element), grad_bytes=grad)
    share = host_split.param_share(
        left=budget - held, floor=host_split.param_floor(resident, largest, swapped),
        ask=resident + row.bytes_per_gpu, optimizer_floor=floor)
    return [i if i is not row else make(
        name=name, tier="cpu", bytes_per_gpu=max(0, share - resident), kind=row.kind,
        formula="the parameter store's share of cpu_budget_bytes less its resident shards")
        for i in items]


def split_moments(items: list, zero: ZeroConfig, host_numel: int, sb: float,
                  nvme_budget: int | None, name: str, make: Callable) -> list:
    """The NVMe moments (item ``name``; paged masters too) with a CPU budget (module doc, 2.):
    the swap buffers become the window and the resident head is held in host memory; the
    disk keeps every home (and the head's too, unless an NVMe budget leaves it out)."""
    from zeroio.shard.swap_rule import moment_split, read_ahead

    moments = next((i for i in items if i.name == name), None)
    swap = next((i for i in items if i.name == "optimizer swap buffers (pinned)"), None)
    held = sum(i.bytes_per_gpu for i in items if i.tier == "cpu" and i is not swap)
    share = zero.tiering.cpu_budget_bytes - held
    if moments is None or swap is None or share <= 0:
        return items
    oo = zero.offload_optimizer
    cut = moment_split(host_numel, share=share, itemsize=sb, nvme_budget=nvme_budget,
                       ahead=read_ahead(zero.tiering.prefetch_depth, bool(oo.pipeline_read)))
    out = [i for i in items if i is not moments and i is not swap]
    if cut.window:  # none where the budget holds every moment
        out.append(make(name="optimizer swap window (pinned)", tier="cpu",
                              bytes_per_gpu=cut.window, kind="zeroio_buffer",
                              formula="(1 + read ahead) pieces' two moments (shard/swap_rule.py)"))
    total = int(2 * sb * host_numel)  # a paged gradient's bytes too: it has its own disk row
    if cut.resident:  # the head: homed in host memory, or cached there beside its disk home
        homed = cut.disk < total
        out.append(make(name=f"{name} {'resident' if homed else 'cached'} in host memory "
                              "(tiering.cpu_budget_bytes)", tier="cpu",
                              bytes_per_gpu=cut.resident, kind="model_state",
                              formula="whole pieces of what the budget leaves past the window"))
    if cut.disk:
        out.append(make(name=name, tier="nvme",
                              bytes_per_gpu=moments.bytes_per_gpu * cut.disk // total,
                              kind="model_state", formula=moments.formula +
                              ("" if cut.disk == total else " - resident head")))
    return out


__all__ = ["LANDING", "param_share", "piece_elems", "split_moments"]
