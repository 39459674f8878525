"""``zeroio.zero``: build partitioned models and look at full parameters (DESIGN.md public API).

    with zeroio.zero.Init(config=cfg):          # parameters partitioned as created
        model = LlamaForCausalLM(llama_cfg)
    with zeroio.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        model.lm_head.weight.normal_()           # rank 0's change is partitioned back on exit

``Init`` is described in zeroio/partition/stage3/init.py ([Note: partition on
registration]). ``GatheredParameters`` gathers the flat groups holding the
given parameters (stage-3 partitioner) or the per-parameter shards left by
``Init`` (before ``zeroio.initialize``), keeps them gathered inside the block,
and with a ``modifier_rank`` broadcasts that rank's values on exit and
stores them back as every rank's shard (and, for a trained model, as the fp32
optimizer masters). Parameters that are not partitioned pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from zeroio.config import Config
from zeroio.errors import ConfigError
from zeroio.partition import collectives as comm
from zeroio.partition.stage3 import pretrained, registry
from zeroio.partition.stage3.init import (
    PartitionOnCreate,
    gather_param,
    repartition_param,
    return_freed_memory,
    write_back_param,
)
from zeroio.partition.stage12 import wait_overlapped_steps


def _init_config(config, hidden_size: int | None = None):
    """The config as zero.Init reads it (``load_init_config``: an "auto" it cannot fill takes
    its default); None without one."""
    if config is None:
        return None
    from zeroio.config import load_init_config

    values = {"world_size": comm.world_size()}
    if hidden_size is not None:
        values["hidden_size"] = hidden_size
    config = load_init_config(config, **values)
    stage = config.zero_optimization.stage
    if stage != 3:
        raise ConfigError(f"zero.Init needs zero_optimization.stage 3, the config has {stage}",
                          key="zero_optimization.stage")
    return config


def _config_dtype(config) -> torch.dtype | None:
    if config is None:
        return None
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return None


def _hidden_size(model_config) -> int | None:
    """Hugging Face's rule for the bucket "auto" keys: ``hidden_size``, else the largest of
    ``hidden_sizes``, else the text config's."""
    for cfg in (model_config, getattr(model_config, "get_text_config", lambda: None)()):
        if cfg is None:
            continue
        sizes = getattr(cfg, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
        size = getattr(cfg, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None


def _default_device() -> torch.device | None:
    # build on the local GPU as DeepSpeed does: initialisers run there, and NCCL can broadcast
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


class Init(PartitionOnCreate):
    """Context manager: modules created inside have their parameters partitioned over ranks.

    ``config`` (path, dict or Config; optional) must have stage 3; its 16-bit
    setting picks the dtype the shards keep unless ``dtype`` is given (fp32
    masters of a 16-bit model then start from the 16-bit values, as DeepSpeed).
    ``enabled=False`` makes it a no-op, as in DeepSpeed. Modules are built on
    the current GPU when there is one (``device`` overrides; the kept shards
    are in host memory either way). A Hugging Face ``PreTrainedModel`` built
    inside gets transformers' own weight initialisation (see [Note: Hugging
    Face init under zero.Init]).
    """

    def __init__(self, *, config=None, dtype: torch.dtype | None = None, enabled: bool = True,
                 data_parallel_group=None, device: torch.device | str | None = "auto"):
        self._source = config
        self.config = _init_config(config) if enabled else None
        """The config as read here (zero_optimization and the 16-bit switches are what count);
        after a ``from_pretrained`` inside, its bucket "auto" keys follow that model's
        hidden size."""
        dtype = dtype if dtype is not None else _config_dtype(self.config)
        device = _default_device() if device == "auto" else device
        super().__init__(group=data_parallel_group, dtype=dtype, enabled=enabled, device=device)
        self._hf = _HFInit(group=data_parallel_group, device=device)
        self._child_handle = None
        self.last_read_stats = None
        """The safetensors reader's counts (reads, bytes_read, largest_read_bytes) of the
        last ``from_pretrained`` inside (None before one; see stage3/pretrained.py)."""

    def pretrained_model(self, model: nn.Module) -> None:
        """``from_pretrained`` is filling ``model`` (built on meta): it is not initialised at
        exit, and the config's bucket "auto" keys take its hidden size."""
        self._hf.skip.update(id(m) for m in model.modules())
        h = _hidden_size(getattr(model, "config", None))
        if h is not None and self._source is not None and not isinstance(self._source, Config):
            self.config = _init_config(self._source, hidden_size=h)

    def _on_register(self, module: nn.Module, name: str, param):
        if param is not None and param.is_meta:  # from_pretrained building its model
            pretrained.patch()
        return super()._on_register(module, name, param)

    def _on_child(self, parent: nn.Module, name: str, child):
        self._hf.saw(parent)
        if _is_hf_model(child):  # its __init__ (and post_init) just returned
            self._hf.run(child)
        return None

    def __enter__(self):
        super().__enter__()
        if self.enabled:
            self._child_handle = register_module_module_registration_hook(self._on_child)
            pretrained.install(self)
        return self

    def __exit__(self, *exc):
        if self._child_handle is not None:
            self._child_handle.remove()
            self._child_handle = None
            pretrained.uninstall(self)
        try:
            if exc[0] is None:  # before the last modules are partitioned: see the note
                self._hf.finish()
        finally:
            self._hf = _HFInit(group=self.group, device=self.device)
            super().__exit__(*exc)
        return False


# [Note: Hugging Face init under zero.Init]
# transformers initialises weights in ``post_init`` at the end of each
# PreTrainedModel's ``__init__``, after its submodules exist; under zero.Init
# most of their parameters are empty placeholders by then, so that pass writes
# nothing (and draws no random numbers). We redo it the way transformers does
# for DeepSpeed (``initialize_weights_zero3``): its own dispatch
# (``smart_apply``: a sub-model uses its own ``_initialize_weights``), children
# before parents, each module's own and direct children's parameters gathered
# just for its call and written back into every rank's shard (peak memory: one
# module; every rank runs the init so the random streams stay in step, rank
# 0's values are kept). It runs for a sub-model the moment it is assigned to
# its parent (its ``__init__`` has just returned: exactly when its own
# post_init ran) and for the outermost models at context exit, and a parameter
# is initialised once (a tied lm_head does not redraw the embedding). So the
# random draws come in the order of a build without zero.Init, and on CPU the
# same seed gives bit-identical weights (tests/test_zero_init_hf.py). Random
# draws made inside the ``with`` block after the model was built come before
# the outermost model's pass and shift it.


def _is_hf_model(module) -> bool:
    import sys

    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(module, mu.PreTrainedModel)


class _HFInit:
    """transformers' ``initialize_weights`` on models partitioned by ``Init`` (see note)."""

    def __init__(self, *, group=None, device: torch.device | None = None):
        self.group, self.device = group, device  # the init runs where the model was built
        self.seen: list[nn.Module] = []
        self.modules: set[int] = set()  # modules this pass initialised
        self.params: set[int] = set()  # parameters this pass initialised
        self.skip: set[int] = set()  # modules of models from_pretrained fills

    def saw(self, parent: nn.Module) -> None:
        if _is_hf_model(parent) and not any(m is parent for m in self.seen):
            self.seen.append(parent)

    def finish(self) -> None:
        inner = {id(m) for top in self.seen for m in top.modules() if m is not top}
        for model in self.seen:
            if id(model) not in inner and id(model) not in self.modules:
                self.run(model)
        self.seen = []

    def run(self, model) -> None:
        from transformers.initialization import guard_torch_init_functions

        if id(model) in self.skip or any(p.is_meta for p in model.parameters()):
            return  # from_pretrained builds on meta and initialises what it does not load

        custom = model.is_remote_code() if hasattr(model, "is_remote_code") else False
        marked: list[nn.Parameter] = []
        try:
            with torch.no_grad(), guard_torch_init_functions():
                self._apply(model, model._initialize_weights, custom, marked)
        finally:
            for p in marked:
                del p._is_hf_initialized

    def _apply(self, module: nn.Module, fn, custom: bool, marked: list) -> None:
        for child in module.children():
            self._apply(child, child._initialize_weights if _is_hf_model(child) else fn,
                        custom, marked)
        if id(module) in self.modules:
            return
        params = {id(p): p for p in module.parameters(recurse=False)}
        for child in module.children():  # _init_weights may reach into direct children
            if not _is_hf_model(child):
                params.update((id(p), p) for p in child.parameters(recurse=False))
        partitioned = [p for p in params.values() if p in registry.INIT_SHARDS]
        if getattr(module, "_is_hf_initialized", False):
            if not partitioned:  # post_init had its full parameters and really wrote them
                self.modules.add(id(module))
                self.params.update(params)
                return
            module._is_hf_initialized = False  # post_init saw placeholders and wrote nothing
        for pid, p in params.items():
            if pid in self.params and not getattr(p, "_is_hf_initialized", False):
                p._is_hf_initialized = True  # transformers' init functions then skip it
                marked.append(p)
        with _Gathered(partitioned, self.group, self.device):
            fn(module, custom)
        self.modules.add(id(module))
        self.params.update(params)


class _Gathered:
    """Full values of ``Init``-partitioned parameters inside the block; rank 0's kept on exit."""

    def __init__(self, params: list[nn.Parameter], group, device=None):
        self.params, self.group, self.device, self.full = params, group, device, []

    def __enter__(self):
        self.full = [gather_param(p, self.group, self.device) for p in self.params]
        for p, full in zip(self.params, self.full, strict=True):
            p.data = full
        return self

    def __exit__(self, *exc):
        try:
            for p, full in zip(self.params, self.full, strict=True):
                write_back_param(p, full, 0, self.group)
        finally:
            self.full = []
        if self.params and comm.world_size(self.group) > 1:
            return_freed_memory()
        return False


def _as_list(params) -> list[nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None] if isinstance(params, Iterable) else [params]


class GatheredParameters:
    """Full parameters inside the block; a ``modifier_rank``'s changes partitioned back on exit."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._owned: dict[int, tuple[object, list[int]]] = {}
        self._init_params: list[nn.Parameter] = []

    def __enter__(self):
        if self.params:  # stage 0-2 parameters may still be written by an overlapped host step
            wait_overlapped_steps()
        seen = set()
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            owner = registry.OWNERS.get(p)
            if owner is not None:
                entry = self._owned.setdefault(id(owner), (owner, []))
                for gi in owner.groups_of([p]):
                    if gi not in entry[1]:
                        entry[1].append(gi)
            elif p in registry.INIT_SHARDS:
                self._init_params.append(p)
        for owner, gis in self._owned.values():
            for gi in gis:
                g = owner.pgroups[gi]
                g.user_holds += 1
                g.finish_gather()
        for p in self._init_params:
            p.data = gather_param(p).clone()
        return self

    def __exit__(self, *exc):
        modify = self.modifier_rank is not None and exc[0] is None
        for owner, gis in self._owned.values():
            for gi in gis:
                g = owner.pgroups[gi]
                if modify:
                    comm.broadcast(g.full_flat(), self.modifier_rank, owner.pg).wait()
                    owner.write_back(gi)
                g.user_holds -= 1
                owner.maybe_release(gi)
        for p in self._init_params:
            if modify:
                repartition_param(p, self.modifier_rank)
            else:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return False


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed compatibility: stage 3 finds parameters used outside their module by itself
    during the first step (see [Note: parameters used outside their module])."""


__all__ = ["Init", "GatheredParameters", "register_external_parameter"]
