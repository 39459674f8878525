"""``from_pretrained`` under ``zero.Init``: each parameter built as its shard, read from the file.

[Note: from_pretrained under zero.Init]
transformers (5.x) builds a model in ``from_pretrained`` on the meta device,
then ``cls._load_pretrained_model(model, state_dict, checkpoint_files,
load_config)`` fills it from the checkpoint files it resolved (a sharded
folder's index already read), then ``cls._finalize_model_loading(model,
load_config, loading_info)`` materialises and initialises the keys the file
lacked, ties the weights and logs the missing/unexpected report. Both are
private static methods (same names and arguments in 5.17 and 5.24), so while
a ``zero.Init`` is entered they are wrapped on ``PreTrainedModel`` and
restored at exit (``install``/``uninstall``); with no transformers loaded
nothing is touched.

- loading (``load_partitioned``): the meta parameters registered during the
  build were left alone by zero.Init (see ``_flush``); each checkpoint key is
  renamed with transformers' own ``rename_source_key`` and the model's
  ``weight_mapping`` (legacy renames, base-model prefix added or removed),
  and each parameter is replaced by a new one whose shard is this rank's
  element range of the tensor, read by ``zeroio.io.safetensors_reader`` with
  one ``pread`` (``init.param_from_file``): no rank ever holds a whole
  parameter, let alone the model. Persistent buffers are read whole (they
  are not partitioned). Keys of the model absent from the files are
  ``missing``, keys of the files the model lacks ``unexpected``, a shape
  that differs ``mismatched``: transformers' own ``LoadStateDictInfo``, so
  its report, ``output_loading_info`` and ``ignore_mismatched_sizes`` behave
  as without zero.Init. Loaded parameters carry ``_is_hf_initialized``, so
  transformers' init skips them.
- what the fast path does not cover (a ``state_dict`` argument, ``.bin``
  files, quantisation, a ``device_map``, a checkpoint key that needs a
  ``WeightConverter`` such as fused experts) goes through transformers'
  loader: it sets each full tensor on its module and zero.Init partitions it
  as created (peak memory then is transformers' own loader's).
- finalising: while transformers materialises the missing keys and
  non-persistent buffers (rotary ``inv_freq``) and runs its init on them,
  zero.Init only queues the new parameters (``holding``), so the init writes
  full tensors; after it, they are partitioned (rank 0's values broadcast,
  as for any module built under zero.Init). Tying happens in between and
  shares the already partitioned parameter object.
"""

from __future__ import annotations

import re
import sys

import torch
from torch import nn

from zeroio.errors import CheckpointError
from zeroio.partition.stage3 import registry
from zeroio.partition.stage3.init import param_from_file
from zeroio.tiering.copies import Copies

_ACTIVE: list = []  # zero.Init contexts entered, innermost last
_SAVED: dict[str, object] = {}  # name -> the descriptor found in PreTrainedModel.__dict__
_NAMES = ("_load_pretrained_model", "_finalize_model_loading")


def install(init) -> None:
    """Route ``from_pretrained`` through ``init`` while it is entered (nested: the innermost)."""
    _ACTIVE.append(init)
    patch()


def patch() -> None:
    """Wrap the two loading steps if transformers is loaded and they are not wrapped yet
    (zero.Init calls it again when a meta parameter is registered: transformers may have
    been imported after the context was entered)."""
    mu = sys.modules.get("transformers.modeling_utils")
    if _SAVED or mu is None or not _ACTIVE:
        return
    cls = mu.PreTrainedModel
    if not all(isinstance(cls.__dict__.get(n), staticmethod) for n in _NAMES):
        return  # another transformers layout: from_pretrained keeps its own (full) loading
    for n in _NAMES:
        _SAVED[n] = cls.__dict__[n]
    cls._load_pretrained_model = staticmethod(_load_pretrained_model)
    cls._finalize_model_loading = staticmethod(_finalize_model_loading)


def uninstall(init) -> None:
    if init in _ACTIVE:
        _ACTIVE.remove(init)
    if _ACTIVE or not _SAVED:
        return
    cls = sys.modules["transformers.modeling_utils"].PreTrainedModel
    for n, desc in _SAVED.items():
        setattr(cls, n, desc)
    _SAVED.clear()


def _original(name: str):
    return _SAVED[name].__func__


def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    init = _ACTIVE[-1] if _ACTIVE else None
    if init is None or not any(p.is_meta for p in model.parameters()):
        return _original("_load_pretrained_model")(model, state_dict, checkpoint_files,
                                                   load_config, *args, **kwargs)
    init.pretrained_model(model)
    plan = None
    if _fast_path_applies(state_dict, checkpoint_files, load_config):
        from zeroio.io.safetensors_reader import SafetensorsReader

        with SafetensorsReader(checkpoint_files) as reader:
            plan = _key_plan(reader.keys(), model, load_config)
            if plan is not None:
                info = load_partitioned(model, reader, plan, load_config, init)
                init.last_read_stats = reader.stats
                return info, None
    return _original("_load_pretrained_model")(model, state_dict, checkpoint_files,
                                               load_config, *args, **kwargs)


def _finalize_model_loading(model, load_config, loading_info):
    init = _ACTIVE[-1] if _ACTIVE else None
    if init is None:
        return _original("_finalize_model_loading")(model, load_config, loading_info)
    held, init.holding = init.holding, True
    try:
        out = _original("_finalize_model_loading")(model, load_config, loading_info)
    finally:
        init.holding = held
    if not held:
        init.flush()
    return out


def _fast_path_applies(state_dict, files, load_config) -> bool:
    return (state_dict is None and bool(files)
            and all(str(f).endswith(".safetensors") for f in files)
            and getattr(load_config, "hf_quantizer", None) is None
            and _whole_model_map(getattr(load_config, "device_map", None)))


def _whole_model_map(device_map) -> bool:
    """No device map, or one that puts the whole model on one device ({"": device}):
    transformers derives the latter from the default-device context zero.Init enters on
    CUDA. Shards go where zero.Init places them either way; a map that splits the model
    across devices goes through transformers' loader."""
    return device_map is None or (isinstance(device_map, dict) and set(device_map) == {""})


def _key_plan(keys: list[str], model, load_config):
    """(checkpoint key -> model key, unexpected keys) as transformers renames them; None when a
    key needs a ``WeightConverter`` (the caller falls back to transformers' loader)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = getattr(load_config, "weight_mapping", None) or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    plan, unexpected = {}, set()
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if target not in expected and key in expected:
            target, pattern = rename_source_key(key, [], [], prefix, expected)
        if pattern is not None:
            return None
        if target in expected:
            plan[key] = target
        else:
            unexpected.add(target)
    return plan, unexpected


def _target_dtype(key: str, ref: torch.Tensor, load_config, init_dtype) -> torch.dtype:
    if not ref.is_floating_point():
        return ref.dtype
    for pattern, dt in (getattr(load_config, "dtype_plan", None) or {}).items():
        if re.search(rf"(^|\.){re.escape(pattern)}(\.|$)", key):  # _keep_in_fp32_modules
            return dt
    return init_dtype or ref.dtype


def _owners(model) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None:
                    out.setdefault(id(t), []).append((mod, name))
    return out


def load_partitioned(model, reader, plan, load_config, init):
    """Fill the meta model from ``reader`` per ``plan`` (see the note); transformers'
    ``LoadStateDictInfo`` of what was missing, unexpected and mismatched."""
    from transformers.utils.loading_report import LoadStateDictInfo

    mapping, unexpected = plan
    expected = model.state_dict(keep_vars=True)
    owners = _owners(model)
    params = {id(p) for p in model.parameters()}
    missing, mismatched, done = set(expected), set(), {}
    for key, target in sorted(mapping.items(), key=lambda kv: kv[1]):
        ref = expected[target]
        missing.discard(target)
        if id(ref) in done:
            continue
        shape = registry.true_shape(ref)  # a parameter built off meta is partitioned already
        if shape != reader.shape(key):
            mismatched.add((target, reader.shape(key), shape))
            continue
        dtype = _target_dtype(target, ref, load_config, init.dtype)
        if id(ref) in params:
            new = param_from_file(reader, key, shape, dtype=dtype,
                                  requires_grad=ref.requires_grad, group=init.group,
                                  device=init.device)
        else:
            new = reader.read(key).to(dtype)
            if init.device is not None:
                new = Copies(None).to(new, init.device)  # before any engine: uncounted
        new._is_hf_initialized = True  # transformers' init leaves it alone
        for module, name in owners.get(id(ref), []):
            setattr(module, name, new)
        done[id(ref)] = new
    try:
        return LoadStateDictInfo(missing_keys=missing, unexpected_keys=unexpected,
                                 mismatched_keys=mismatched, conversion_errors={},
                                 error_msgs=[], skipped_pp_keys=set())
    except TypeError as e:  # a transformers whose report has other fields
        raise CheckpointError(f"zero.Init cannot report this transformers' loading info ({e}); "
                              "load without zero.Init or use transformers 5.17-5.24") from None


__all__ = ["install", "patch", "uninstall", "load_partitioned"]
