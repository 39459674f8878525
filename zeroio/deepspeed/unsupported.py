"""DeepSpeed's names the facade does not serve, each failing with one line that says what
zeroio offers instead.

Modules (``import deepspeed.moe.layer``, ``from deepspeed.pipe import PipelineModule``) raise
``NotServedImportError`` (an ``ImportError``, so a library's ``try: import ... except
ImportError`` probe still works); top-level names (``deepspeed.init_inference``) raise
``NotServedAttributeError`` (an ``AttributeError``, so ``hasattr`` still answers False).
``install_finder`` puts the module finder on ``sys.meta_path`` when the facade's ``deepspeed``
package is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from zeroio.errors import NotServedAttributeError, NotServedImportError

_DATA_PARALLEL = "zeroio is ZeRO data parallelism (stages 1-3, offload to CPU/NVMe)"

MODULES = {
    "moe": "mixture-of-experts layers and expert parallelism are not served; " + _DATA_PARALLEL
           + ": a MoE model built from torch modules trains at any stage, stage 3 gathering the "
           "experts each forward touches",
    "pipe": "pipeline parallelism is not served; " + _DATA_PARALLEL + ": train the whole model "
            "at stage 3, its parameters partitioned over the ranks (offload_param for more)",
    "inference": "DeepSpeed inference is not served (zeroio trains); generate at stage 3 with "
                 "transformers' generate(synced_gpus=True) on engine.module",
    "module_inject": "kernel injection and tensor parallelism are not served; " + _DATA_PARALLEL,
    "compression": "DeepSpeed compression (quantization-aware training, pruning) is not served",
    "profiling": "DeepSpeed's flops profiler is not served; engine.stats() reports the bytes "
                 "moved per tier and the step's time breakdown, torch.profiler shows zeroio's "
                 "phases (zeroio::forward, zeroio::backward, zeroio::step)",
    "autotuning": "the autotuner is not served; `zeroio estimate --plan` and `zeroio train "
                  "--plan` pick the stage, offload and ratio that fit the machine",
    "sequence": "Ulysses sequence parallelism is not served; " + _DATA_PARALLEL,
    "elasticity": "elastic training is not served; a zeroio checkpoint resumes at any world "
                  "size (docs/checkpoint.md)",
    "ops.transformer": "DeepSpeed's fused transformer kernels are not served; keep the "
                       "model's own layers",
    "ops.sparse_attention": "sparse attention kernels are not served",
    "runtime.pipe": "pipeline parallelism is not served; " + _DATA_PARALLEL,
    "runtime.hybrid_engine": "the RLHF hybrid engine is not served; TRL's trainers run on "
                             "zeroio through the facade (docs/transformers.md)",
    "linear": "DeepSpeed's LoRA/quantized linear layers are not served; PEFT's LoRA trains on "
              "zeroio at any stage",
}
"""Module (below ``deepspeed.``) -> why it is not served and what zeroio offers."""

ATTRIBUTES = {
    "init_inference": MODULES["inference"],
    "InferenceEngine": MODULES["inference"],
    "DeepSpeedInferenceConfig": MODULES["inference"],
    "PipelineModule": MODULES["pipe"],
    "PipelineEngine": MODULES["pipe"],
    "DeepSpeedHybridEngine": MODULES["runtime.hybrid_engine"],
    "DeepSpeedTransformerLayer": MODULES["ops.transformer"],
    "DeepSpeedTransformerConfig": MODULES["ops.transformer"],
    "replace_transformer_layer": MODULES["module_inject"],
    "revert_transformer_layer": MODULES["module_inject"],
    "tp_model_init": MODULES["module_inject"],
    "set_autotp_mode": MODULES["module_inject"],
    "add_tuning_arguments": MODULES["autotuning"],
    "OnDevice": "deepspeed.OnDevice is not served; build the model under `with "
                "torch.device('meta'):` or `deepspeed.zero.Init(...)` (partitioned as created)",
}
"""Top-level ``deepspeed`` names -> why they are not served and what zeroio offers."""


def _served_elsewhere(name: str) -> str | None:
    """The table entry for module ``deepspeed.<name>`` or the module it is inside."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        why = MODULES.get(".".join(parts[:n]))
        if why is not None:
            return why
    return None


def attribute_error(name: str) -> AttributeError:
    """What ``deepspeed.<name>`` raises when the facade has no such name."""
    why = ATTRIBUTES.get(name)
    if why is None:
        why = ("zeroio's deepspeed facade does not serve it; docs/deepspeed.md lists the "
               "DeepSpeed names zeroio serves")
    return NotServedAttributeError(f"deepspeed.{name}: {why}")


class _NotServedLoader(importlib.abc.Loader):
    def __init__(self, why: str):
        self.why = why

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        raise NotServedImportError(f"{module.__name__}: {self.why}", name=module.__name__)


class NotServedFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.<module>`` of ``MODULES`` (and below) with a loader that raises."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        why = _served_elsewhere(fullname.removeprefix("deepspeed."))
        if why is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _NotServedLoader(why),
                                              is_package=True)


def install_finder() -> None:
    if not any(isinstance(f, NotServedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, NotServedFinder())
