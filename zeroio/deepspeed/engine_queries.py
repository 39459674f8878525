"""The config questions DeepSpeed's engine answers (``engine.fp16_enabled()``,
``engine.zero_offload_optimizer()``, ...), answered from the zeroio engine's resolved config.

A mixin of ``DeepSpeedEngine`` (engine_adapter.py): it reads ``self.zeroio_engine.config``
and nothing else. Names and return values are DeepSpeed's (``deepspeed/runtime/engine.py``);
where DeepSpeed returns one of its config objects (``zero_offload_optimizer()``), zeroio
returns its own block with the same field names (``device``, ``nvme_path``, ``pin_memory``,
...), or None where DeepSpeed returns None (no offload).
"""

from __future__ import annotations

import torch


class EngineQueries:
    """DeepSpeed's ``DeepSpeedEngine`` config getters over ``self.zeroio_engine.config``."""

    @property
    def _zeroio_config(self):
        return self.zeroio_engine.config

    def zero_optimization_stage(self) -> int:
        return self._zeroio_config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_offload_optimizer(self):
        block = self._zeroio_config.zero_optimization.offload_optimizer
        return block if block.device.value != "none" else None

    def zero_offload_param(self):
        block = self._zeroio_config.zero_optimization.offload_param
        return block if block.device.value != "none" else None

    def zero_use_cpu_optimizer(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device.value in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device.value == "cpu"

    def zero_partial_offload(self) -> float:
        return self._zeroio_config.zero_optimization.offload_optimizer.ratio

    def zero_sub_group_size(self) -> int:
        return self._zeroio_config.zero_optimization.sub_group_size

    def zero_reduce_bucket_size(self) -> int:
        return self._zeroio_config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self._zeroio_config.zero_optimization.allgather_bucket_size

    def zero_contiguous_gradients(self) -> bool:
        return self._zeroio_config.zero_optimization.contiguous_gradients

    def zero_overlap_comm(self) -> bool:
        return bool(self._zeroio_config.zero_optimization.overlap_comm)

    def fp16_enabled(self) -> bool:
        return self._zeroio_config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._zeroio_config.bf16.enabled

    def amp_enabled(self) -> bool:
        return False  # zeroio has no apex amp

    def loss_scale(self) -> float:
        """The config's ``fp16.loss_scale`` (0: dynamic), as DeepSpeed's getter."""
        return self._zeroio_config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale() == 0

    def gradient_clipping(self) -> float:
        return self._zeroio_config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self._zeroio_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._zeroio_config.wall_clock_breakdown

    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the compute dtype."""
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            self._zeroio_config.compute_dtype, torch.float32)

    def get_batch_info(self) -> tuple[int, int, int]:
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def train_batch_size(self) -> int:
        return self._zeroio_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._zeroio_config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._zeroio_config.gradient_accumulation_steps

    def optimizer_name(self) -> str | None:
        client = self.zeroio_engine.client_optimizer
        if client is not None:
            return type(client).__name__
        block = self._zeroio_config.optimizer
        return block.type if block is not None else None

    def get_type(self) -> list:
        return [group.get("type") for group in self.zeroio_engine.optimizer.param_groups]

    def get_mom(self) -> list:
        name = (self.optimizer_name() or "").lower()
        key = "momentum" if name in ("sgd", "rmsprop") else "betas"
        return [group.get(key) for group in self.zeroio_engine.optimizer.param_groups]
