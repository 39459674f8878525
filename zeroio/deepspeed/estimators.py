"""DeepSpeed's model-state memory estimators (``deepspeed.runtime.zero.stage3`` /
``stage_1_and_2``), computed from zeroio's estimate.

Same names, signatures and printed table as DeepSpeed's (per CPU | per GPU | options, for
each offload choice and, at stage 3, with and without ``zero.Init``); the numbers are
``zeroio.estimate_memory``'s model states (the ZeRO paper's count: 16-bit parameters and
gradients, K = 12 bytes of Adam state per parameter, split over the ranks by stage and moved
to the host by offload), without the buffers zeroio adds, as DeepSpeed's function counts
model states only:

- per GPU: the model states a rank keeps on its GPU; at stage 3 plus the largest layer
  gathered, its 16-bit values and gradient (2 x 2 bytes per element, DeepSpeed's term);
- per CPU: the model states a node keeps in host memory, times ``additional_buffer_factor``
  (DeepSpeed's margin, applied as DeepSpeed applies it); without ``zero.Init`` (stage 3,
  ``zero_init=0``) at least each rank's whole fp32 model (4 bytes per parameter per GPU of
  the node), which it builds before ``initialize`` partitions it.

``zeroio estimate`` prints the full estimate with zeroio's own buffers. The ``*_all_live``
and ``*_all_cold`` functions print the table and also return its rows (DeepSpeed's return
None); ``estimate_zero*_model_states_mem_needs`` return DeepSpeed's tuples.
"""

from __future__ import annotations

import math

import torch

from zeroio.deepspeed.params import full_shape
from zeroio.estimate import estimate_memory

BYTES_16 = 2


def _numel(p: torch.nn.Parameter) -> int:
    shape = full_shape(p)  # the full size of a parameter zero.Init partitioned
    return math.prod(shape) if shape is not None else p.numel()


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, tied ones once; the most parameters one module holds itself)."""
    total = sum(_numel(p) for p in {id(p): p for p in model.parameters()}.values())
    largest = max((sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def _model_states(total_params, stage, gpus_per_node, num_nodes, offload_optimizer,
                  offload_param):
    est = estimate_memory(total_params, gpus_per_node, num_nodes, stage, offload_optimizer,
                          offload_param, "fp16", zeroio_buffers=False)
    return est.cpu_bytes_per_node, est.gpu_bytes_per_gpu


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1,
                                          num_nodes=1, cpu_offload=True, cpu_offload_params=True,
                                          zero_init=True, additional_buffer_factor=1.5):
    """(CPU bytes per node, GPU bytes per GPU, the largest layer's GPU bytes)."""
    cpu, gpu = _model_states(total_params, 3, num_gpus_per_node, num_nodes,
                             "cpu" if cpu_offload else "none",
                             "cpu" if cpu_offload_params else "none")
    largest_layer_memory = 2 * BYTES_16 * largest_layer_params
    if not zero_init:
        cpu = max(cpu, 4 * total_params * num_gpus_per_node)
    return int(cpu * additional_buffer_factor), int(gpu + largest_layer_memory), \
        largest_layer_memory


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, additional_buffer_factor=1.5):
    """(CPU bytes per node, GPU bytes per GPU) at stage 2."""
    cpu, gpu = _model_states(total_params, 2, num_gpus_per_node, num_nodes,
                             "cpu" if cpu_offload else "none", "none")
    return int(cpu * additional_buffer_factor), int(gpu)


def _header(total_params, num_gpus_per_node, num_nodes, largest=None) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    sw = f"SW: Model with {int(total_params / 1e6)}M total params"
    sw += f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{sw}\n"
          "(zeroio's estimate of the model states; `zeroio estimate` adds zeroio's buffers)")
    print("  per CPU  |  per GPU |   Options")


def _row(cpu: int, gpu: int, options: str) -> None:
    print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                   num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> list[dict]:
    _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    rows = []
    for offload_opt, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                cpu_offload=offload_opt, cpu_offload_params=offload_params, zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor)
            row = {"offload_param": "cpu" if offload_params else "none",
                   "offload_optimizer": "cpu" if offload_opt else "none",
                   "zero_init": zero_init, "cpu_bytes": cpu, "gpu_bytes": gpu}
            _row(cpu, gpu, f"offload_param={row['offload_param']:4}, offload_optimizer="
                           f"{row['offload_optimizer']:4}, zero_init={int(zero_init)}")
            rows.append(row)
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> list[dict]:
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> list[dict]:
    _header(total_params, num_gpus_per_node, num_nodes)
    rows = []
    for offload_opt in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload=offload_opt,
            additional_buffer_factor=additional_buffer_factor)
        row = {"offload_optimizer": "cpu" if offload_opt else "none", "cpu_bytes": cpu,
               "gpu_bytes": gpu}
        _row(cpu, gpu, f"offload_optimizer={row['offload_optimizer']:4}")
        rows.append(row)
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> list[dict]:
    total, _ = model_to_params(model)
    return estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor)
