"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 model-state estimators, from zeroio's estimate."""

from zeroio.deepspeed.estimators import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live", "model_to_params"]
