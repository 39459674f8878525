"""``deepspeed.comm`` on zeroio: DeepSpeed's collectives and getters over torch.distributed.

Signatures are DeepSpeed's (``deepspeed/comm/comm.py``); each collective is
torch.distributed's through zeroio's collectives module ([Note: client collectives] in
zeroio/partition/collectives.py: gloo gets reduce-scatter, all-gather into one tensor and
``ReduceOp.AVG``). ``async_op=True`` returns a handle whose ``wait()`` finishes it (DeepSpeed
returns torch's work object, which has the same ``wait()``). DeepSpeed's profiling arguments
(``prof``, ``log_name``, ``debug``) are accepted and not used: zeroio keeps no comms log.
"""

from __future__ import annotations

from zeroio.config.launch_env import launch_env
from zeroio.deepspeed.ranks import barrier as _barrier
from zeroio.deepspeed.ranks import get_rank, get_world_size, is_initialized
from zeroio.partition import collectives as _c

ReduceOp = _c.ReduceOp

__all__ = ["ReduceOp", "all_reduce", "inference_all_reduce", "reduce", "broadcast", "all_gather",
           "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter",
           "reduce_scatter_fn", "all_to_all_single", "all_to_all", "gather", "scatter", "send",
           "recv", "isend", "irecv", "barrier", "monitored_barrier", "broadcast_object_list",
           "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_world_group",
           "get_all_ranks_from_group", "new_group", "is_initialized", "is_available",
           "destroy_process_group", "has_all_gather_into_tensor", "has_reduce_scatter_tensor"]


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
               log_name="all_reduce", debug=None):
    return _c.client_op("all_reduce", tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):
    """DeepSpeed's fast path for inference kernels; here the same all-reduce."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
           log_name="reduce", debug=None):
    return _c.client_op("reduce", tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast",
              debug=None):
    return _c.client_op("broadcast", tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src, group=None, device=None):
    return _c.client_op("broadcast_object_list", object_list, src, group=group, device=device)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False,
               log_name="all_gather", debug=None):
    return _c.client_op("all_gather", tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return _c.client_op("all_gather_into_tensor", output_tensor, tensor, group=group,
                        async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                          prof=False, log_name="reduce_scatter_tensor", debug=None):
    return _c.client_op("reduce_scatter_tensor", output_tensor, tensor, op=op, group=group,
                        async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                      prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    return _c.client_op("reduce_scatter", output, input_list, op=op, group=group,
                        async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False, prof=False, log_name="all_to_all_single",
                      debug=None):
    return _c.client_op("all_to_all_single", output, tensor, output_split_sizes,
                        input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return _c.client_op("all_to_all", output_tensor_list, input_tensor_list, group=group,
                        async_op=async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False,
           log_name="gather", debug=None):
    return _c.client_op("gather", tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False,
            log_name="scatter", debug=None):
    return _c.client_op("scatter", tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return _c.client_op("send", tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return _c.client_op("recv", tensor, src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return _c.client_op("send", tensor, dst, group=group, tag=tag, async_op=True)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return _c.client_op("recv", tensor, src, group=group, tag=tag, async_op=True)


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier",
            debug=None):
    _barrier(group)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False,
                      log_name="monitored_barrier", debug=None):
    """A barrier; a rank that does not arrive is named after the group's timeout, as for every
    collective zeroio runs."""
    _barrier(group)


def get_local_rank() -> int:
    return launch_env().local_rank


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return _c.global_rank(group, group_rank)


def get_world_group():
    return _c.world_group()


def get_all_ranks_from_group(group=None) -> list[int]:
    return _c.group_ranks(group)


def new_group(ranks):
    return _c.new_group(ranks)


def is_available() -> bool:
    return True


def destroy_process_group(group=None) -> None:
    """Leave the world (zeroio's groups with it); ``group``: as torch, that group only."""
    if group is None:
        _c.destroy_world()
    else:
        _c.destroy_group(group)


def has_all_gather_into_tensor() -> bool:
    return True  # gloo gets it from zeroio


def has_reduce_scatter_tensor() -> bool:
    return True
