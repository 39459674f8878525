"""Recover a zeroio checkpoint's weights as safetensors with numpy and zarr alone.

    python recover.py CKPT OUT [--tag TAG] [--dtype fp32|bf16|fp16] [--max-shard-size BYTES]
    python -m zeroio.io.recover CKPT OUT ...

The standalone way out, for a machine without zeroio or torch (the role
DeepSpeed's ``zero_to_fp32.py`` plays): this file imports only the standard
library, numpy and zarr, so it can be copied anywhere and run. CKPT is a
checkpoint directory (the newest complete tag, or ``--tag``) or one tag folder.
OUT receives what ``zeroio consolidate CKPT OUT`` writes, byte for byte: one
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` above ``--max-shard-size``, 5e9 bytes by
default) and, for a Hugging Face model, its ``config.json``.

The format, as this script reads it (docs/checkpoint.md): ``<tag>/manifest.json``
is the commit point (a tag without one is an interrupted save); its
``model.index`` lists ``[name, offset, shape]`` of every parameter in one flat
1-D array; ``arrays`` names the arrays (weights are ``fp32``, else ``param16``)
with their stored dtype; each array is a zarr v3 array ``<tag>/<kind>/`` of raw
little-endian chunks, 16-bit floats stored as their raw bits (``uint16``) with
the torch dtype named in the manifest; ``meta.hf_config`` is the model's config.
Unknown manifest keys are ignored. Chunk checksums (crc32c) are checked with
``--verify`` when the ``google_crc32c`` package is importable, and so is the
manifest's own crc32c (format 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import zarr

FORMAT = "zeroio-checkpoint"
READS_FORMAT_VERSION = 2  # 2 adds the manifest's own crc32c ("manifest_crc32c")
WEIGHT_KINDS = ("fp32", "param16")
_ST_NAME = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
            "int64": "I64", "int32": "I32", "uint8": "U8"}
_DTYPE_ARG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class RecoverError(Exception):
    """The checkpoint cannot be recovered as asked; the message says why and what to do."""


def find_tag(ckpt: Path, tag: str | None) -> Path:
    """The tag folder to read: ``ckpt`` itself when it holds a manifest, else ``ckpt/tag``
    or the tag ``ckpt/latest`` names."""
    if (ckpt / "manifest.json").is_file() and tag is None:
        return ckpt
    if tag is None:
        try:
            tag = (ckpt / "latest").read_text(encoding="utf-8").strip()
        except OSError:
            raise RecoverError(f"{ckpt} has no 'latest' file and no manifest.json; pass the "
                               "checkpoint directory, a tag folder, or --tag") from None
    if not tag or "/" in tag or tag in (".", ".."):
        raise RecoverError(f"tag {tag!r} is not one folder name")
    tdir = ckpt / tag
    if not (tdir / "manifest.json").is_file():
        raise RecoverError(f"{tdir} has no manifest.json: not a complete checkpoint (an "
                           "interrupted save?); pick another tag with --tag")
    return tdir


def read_manifest(tdir: Path) -> dict:
    """The manifest's fields this script needs, checked; other keys are ignored."""
    path = tdir / "manifest.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecoverError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecoverError(f"{path} is not a zeroio checkpoint manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > READS_FORMAT_VERSION:
        raise RecoverError(f"{path}: format_version {version!r}; this script reads up to "
                           f"{READS_FORMAT_VERSION}")
    try:
        index = [(str(n), int(off), tuple(int(s) for s in shape))
                 for n, off, shape in doc["model"]["index"]]
        arrays = {str(k): dict(v) for k, v in doc["arrays"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise RecoverError(f"{path}: damaged model index or arrays ({e!r})") from None
    for name in arrays:  # used as folder names below: one plain component each
        if not name or name.startswith(".") or "/" in name or "\\" in name:
            raise RecoverError(f"{path}: array name {name!r} is not one folder name")
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    return {"index": index, "arrays": arrays, "hf_config": meta.get("hf_config"),
            "manifest_crc32c": doc.get(MANIFEST_CRC_KEY), "doc": doc}


MANIFEST_CRC_KEY = "manifest_crc32c"


def verify_manifest(man: dict, path: Path) -> None:
    """The manifest's own crc32c (format 2): over its JSON without that key, keys sorted,
    no spaces (needs google_crc32c; a format-1 manifest has none to check)."""
    want = man.get("manifest_crc32c")
    if want is None:
        return
    try:
        import google_crc32c
    except ImportError:
        raise RecoverError("--verify needs the google_crc32c package") from None
    body = {k: v for k, v in man["doc"].items() if k != MANIFEST_CRC_KEY}
    crc = google_crc32c.value(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    if crc != want:
        raise RecoverError(f"{path}: the manifest's crc32c does not match its contents; it is "
                           "damaged or was edited")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (NaN -> 0x7FC0), as torch casts."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def convert(values: np.ndarray, stored: str, target: str) -> np.ndarray:
    """``values`` as zarr returns them (16-bit floats as uint16 bits) cast from ``stored`` to
    ``target`` (torch dtype names); the result's bytes are the safetensors bytes."""
    if stored == target:
        return values
    if stored == "bfloat16":
        f32 = _bf16_bits_to_f32(values)
    elif stored == "float16":
        f32 = values.view(np.float16).astype(np.float32)
    else:
        f32 = values.astype(np.float32)
    if target == "float32":
        return f32
    if target == "bfloat16":
        return _to_bf16_bits(f32)
    if target == "float16":
        return f32.astype(np.float16)
    raise RecoverError(f"cannot write dtype {target}")


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], itemsize: int,
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Model-order runs of at most ``max_shard_bytes`` (a larger tensor alone), as zeroio's."""
    shards, cur, size = [], [], 0
    for name, shape in specs:
        nbytes = _numel(shape) * itemsize
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def _header(shard, st_dtype: str, itemsize: int) -> tuple[bytes, list]:
    order = sorted(shard, key=lambda s: s[0])  # safetensors' order within one dtype
    doc: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in order:
        nbytes = _numel(shape) * itemsize
        doc[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head, order


def verify_chunks(tdir: Path, kind: str, info: dict) -> None:
    """Check each chunk file's crc32c against the manifest (needs google_crc32c)."""
    try:
        import google_crc32c
    except ImportError:
        raise RecoverError("--verify needs the google_crc32c package") from None
    for i, want in enumerate(info.get("chunk_crc32c", [])):
        path = tdir / kind / "c" / str(i)
        crc = google_crc32c.Checksum()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):  # noqa: B023 - f is this chunk's
                crc.update(block)
        if int.from_bytes(crc.digest(), "big") != int(want):
            raise RecoverError(f"{path}: crc32c mismatch; this chunk is damaged")


def recover(ckpt: str | os.PathLike, out: str | os.PathLike, *, tag: str | None = None,
            dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
            verify: bool = False) -> list[Path]:
    """Write checkpoint ``ckpt`` (tag ``tag``) as a safetensors folder ``out``; the files."""
    tdir = find_tag(Path(ckpt), tag)
    man = read_manifest(tdir)
    kind = next((k for k in WEIGHT_KINDS if k in man["arrays"]), None)
    if kind is None:
        raise RecoverError(f"{tdir} holds no weights array ({' or '.join(WEIGHT_KINDS)})")
    stored = str(man["arrays"][kind].get("dtype"))
    target = _DTYPE_ARG[dtype] if dtype else stored
    if target not in _ST_NAME:
        raise RecoverError(f"stored dtype {stored!r} has no safetensors name")
    if verify:
        verify_manifest(man, tdir / "manifest.json")
        verify_chunks(tdir, kind, man["arrays"][kind])
    arr = zarr.open_array(store=str(tdir / kind), mode="r")
    itemsize = np.dtype({"bfloat16": "uint16"}.get(target, target)).itemsize
    index = {name: (off, shape) for name, off, shape in man["index"]}
    shards = plan_shards([(n, s) for n, (_, s) in index.items()], itemsize, max_shard_bytes)
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = []
    for fname, shard in zip(names, shards, strict=True):
        head, order = _header(shard, _ST_NAME[target], itemsize)
        final, tmp = outdir / fname, outdir / f".{fname}.partial"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                for name, shape in order:
                    off, n = index[name][0], _numel(shape)
                    values = np.asarray(arr[off:off + n]) if n else np.zeros(0, arr.dtype)
                    f.write(np.ascontiguousarray(convert(values, stored, target)).tobytes())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        written.append(final)
    if len(shards) > 1:
        total = sum(_numel(s) * itemsize for _, s in index.values())
        weight_map = {n: fname for fname, shard in zip(names, shards, strict=True)
                      for n, _ in shard}
        idx = outdir / "model.safetensors.index.json"
        idx.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                  indent=2) + "\n")
        written.append(idx)
    if man["hf_config"]:
        cfg = dict(man["hf_config"])
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = target
        (outdir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        written.append(outdir / "config.json")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="recover.py", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or one tag folder")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--tag", default=None, help="tag to read (default: the one `latest` names)")
    p.add_argument("--dtype", choices=tuple(_DTYPE_ARG), default=None,
                   help="dtype of the written weights (default: as stored)")
    p.add_argument("--max-shard-size", type=int, default=5 * 10**9, metavar="BYTES",
                   help="largest safetensors file before sharding (default 5000000000)")
    p.add_argument("--verify", action="store_true",
                   help="check every chunk's crc32c first (needs google_crc32c)")
    args = p.parse_args(argv)
    try:
        files = recover(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype,
                        max_shard_bytes=args.max_shard_size, verify=args.verify)
    except RecoverError as e:
        print(f"recover: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} file(s) to {args.out}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
