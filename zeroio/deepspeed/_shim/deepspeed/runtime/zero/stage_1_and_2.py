"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 model-state estimators, from zeroio's
estimate."""

from zeroio.deepspeed.estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live"]
