"""Taking the model out: a checkpoint's weights as full tensors or a safetensors folder.

No conversion script and no engine: the manifest's index says where each
parameter lies in the flat "fp32" array, so the full tensors are read
straight from the chunks (verified), cast, and written shard by shard, so
memory holds one output shard at a time. When the model was a Hugging Face
PreTrainedModel its config was stored in the manifest and becomes
config.json, so `from_pretrained(OUT)` loads the folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from zeroio.checkpoint.layout import Manifest
from zeroio.checkpoint.reader import ArrayReader, _Request, resolve_tag
from zeroio.errors import CheckpointError

WEIGHT_KINDS = ("fp32", "param16")  # preferred source of weights, in order
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name!r} is not one of {sorted(_DTYPES)}") from None


def weight_kind(manifest: Manifest) -> str:
    for k in WEIGHT_KINDS:
        if k in manifest.arrays:
            return k
    raise CheckpointError(
        f"checkpoint {manifest.path} holds no weights array ({' or '.join(WEIGHT_KINDS)}); "
        f"it has {sorted(manifest.arrays)}"
    )


def _read_params(reader: ArrayReader, kind: str, names: list[str], dtype, desc: str) -> dict[str, torch.Tensor]:
    info = reader.info(kind)
    idx = reader.manifest.index
    out = {n: torch.empty(idx[n].shape, dtype=info.dtype) for n in names}
    reader.read_requests(kind, [_Request(idx[n].offset, out[n].view(-1)) for n in names], desc=desc)
    if dtype is not None:
        out = {n: t.to(dtype) for n, t in out.items()}
    return out


def consolidate(checkpoint_dir: str | os.PathLike, tag: str | None = None, *,
                dtype: str | torch.dtype | None = None, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of checkpoint ``tag`` (default: latest) as a full tensor, in model order."""
    manifest = resolve_tag(checkpoint_dir, tag)
    reader = ArrayReader(manifest, progress=progress)
    kind = weight_kind(manifest)
    return _read_params(reader, kind, list(manifest.index), parse_dtype(dtype), f"read {manifest.tag}")


def _file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_config(out: Path, hf_config: dict | None, dtype: torch.dtype | None) -> list[Path]:
    if not hf_config:
        return []
    cfg = dict(hf_config)
    if dtype is not None:
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return [out / "config.json"]


def _write_shards(out: Path, shards: list[list[str]], load_shard, total: int, progress: bool, desc: str):
    from safetensors.torch import save_file

    names = _file_names(len(shards))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress)
    weight_map, written = {}, []
    for fname, shard in zip(names, shards, strict=True):
        tensors = load_shard(shard, fname)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
        weight_map.update({n: fname for n in shard})
        bar.update(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / "model.safetensors.index.json")
    return written


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for name, nbytes in sizes:
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def write_folder(tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike, *, hf_config: dict | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> list[Path]:
    """Write in-memory full tensors as a safetensors folder (sharded + index when large)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    dtype = next(iter(tensors.values())).dtype if tensors else None
    written = _write_shards(out, shards, lambda names, _f: {n: tensors[n].contiguous() for n in names},
                            sum(s for _, s in sizes), progress, "save 16-bit model")
    return written + _write_config(out, hf_config, dtype)


def write_safetensors(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None = None, *,
                      dtype: str | torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> list[Path]:
    """Write checkpoint ``tag`` as a safetensors folder (+ index when sharded, + HF config.json)."""
    manifest = resolve_tag(checkpoint_dir, tag)
    kind = weight_kind(manifest)
    dt = parse_dtype(dtype) or manifest.arrays[kind].dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = ArrayReader(manifest)
    sizes = [(n, e.numel * dt.itemsize) for n, e in manifest.index.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    written = _write_shards(out, shards, lambda names, f: _read_params(reader, kind, names, dt, f),
                            manifest.numel * dt.itemsize, progress, f"consolidate {manifest.tag}")
    return written + _write_config(out, manifest.meta.get("hf_config"), dt)
