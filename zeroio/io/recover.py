"""Recover a zeroio checkpoint's weights as safetensors with the standard library and numpy alone.

    python recover.py CKPT OUT [--tag TAG] [--dtype fp32|bf16|fp16] [--max-shard-size BYTES] [--verify]
    python -m zeroio.io.recover CKPT OUT ...

The standalone way out, for a machine without zeroio or torch (the role of DeepSpeed's
``zero_to_fp32.py``): only the standard library and numpy (``google_crc32c`` when
installed, for speed), so it can be copied anywhere. CKPT is a checkpoint directory (the
tag ``latest`` names, or ``--tag``) or one tag folder. OUT receives what ``zeroio
consolidate CKPT OUT`` writes, byte for byte: ``model.safetensors`` (or shards and
``model.safetensors.index.json`` above ``--max-shard-size``, 5e9 bytes by default) and,
for a Hugging Face model, its ``config.json``.

[Note: the manifest is the truth] The format, as this script reads it
(docs/checkpoint.md; format versions 1, 2 and 3): ``<tag>/manifest.json`` is the
commit point (a tag without one is an interrupted save). Its ``model.index``
lists ``[name, offset, shape]`` of every parameter in one flat 1-D array and
must tile it exactly; ``arrays`` gives each array's ``numel``, ``dtype`` and
either ``chunk_elems`` with one ``chunk_crc32c`` per chunk, or (format 3, NVMe
moments) ``layout: extents`` with extent files and their crcs. The weights
(``fp32``, else ``param16``) are always chunked: ``<tag>/<kind>/c/<i>`` holds
``chunk_elems`` raw little-endian elements (the last chunk zero-padded to full
size), 16-bit floats as their raw bits. From format 2 on, ``manifest_crc32c``
is the crc32c of the rest of the document as canonical JSON. Everything is
checked against the manifest, never against the array's ``zarr.json`` (a
``zarr.json`` that disagrees with it is an error naming it): each chunk is
present, exactly ``chunk_elems`` elements long, and of the recorded crc32c
before a byte of it is written. Output is written into a hidden folder beside
OUT and moved into place only when complete; an export already in OUT is
replaced whole ([Note: replacing an export]). Every error is one line naming
the file, and the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

import numpy as np

FORMAT = "zeroio-checkpoint"
READS_FORMAT_VERSION = 3  # 1: the first; 2: manifest_crc32c; 3: arrays stored as extents
MANIFEST_CRC_KEY = "manifest_crc32c"
WEIGHT_KINDS = ("fp32", "param16")
# stored torch dtype -> (numpy dtype of the stored bits, zarr data_type, safetensors name)
_DTYPES = {"float32": ("<f4", "float32", "F32"), "float64": ("<f8", "float64", "F64"),
           "bfloat16": ("<u2", "uint16", "BF16"), "float16": ("<u2", "uint16", "F16"),
           "int64": ("<i8", "int64", "I64"), "int32": ("<i4", "int32", "I32"),
           "uint8": ("u1", "uint8", "U8")}
_DTYPE_ARG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_EXTENT_RE = re.compile(r"^r[0-9]{5}-[0-9]{6}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class RecoverError(Exception):
    """The checkpoint cannot be recovered as asked; the message names the file and what to do."""


# -- crc32c (Castagnoli): google_crc32c when installed, else numpy ------------------------

_POLY = 0x82F63B78  # reflected


def _byte_table() -> list[int]:
    table = []
    for b in range(256):
        r = b
        for _ in range(8):
            r = (r >> 1) ^ _POLY if r & 1 else r >> 1
        table.append(r)
    return table


_TABLE = _byte_table()
_NP_TABLE = np.array(_TABLE, dtype=np.uint32)
_LANES = 16384  # bytes processed side by side by the numpy path


def _mulmod(a: int, b: int) -> int:
    """a * b modulo the polynomial, reflected bit order (x^0 is bit 31)."""
    p = 0
    for bit in range(31, -1, -1):
        if a & (1 << bit):
            p ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x_pow_8n(n: int) -> int:
    """x^(8n) mod P: the factor that appending n bytes applies to a crc."""
    result, square, k = 1 << 31, 1 << 23, n  # x^0; x^8
    while k:
        if k & 1:
            result = _mulmod(square, result)
        square = _mulmod(square, square)
        k >>= 1
    return result


def _crc_py(data, crc: int) -> int:
    r = crc ^ 0xFFFFFFFF
    for b in bytes(data):
        r = _TABLE[(r ^ b) & 0xFF] ^ (r >> 8)
    return r ^ 0xFFFFFFFF


def _crc_numpy(data: np.ndarray) -> int:
    """crc32c of a uint8 array: ``_LANES`` equal lanes stepped together a byte at a time,
    joined with crc(A || B) = crc(A) * x^(8 len B) + crc(B) (crc32c is linear), then the tail."""
    n = data.size // _LANES * _LANES
    if n == 0:
        return _crc_py(data, 0)
    step = n // _LANES
    cols = np.ascontiguousarray(data[:n].reshape(_LANES, step).T)
    reg = np.full(_LANES, 0xFFFFFFFF, dtype=np.uint32)
    for j in range(step):
        reg = _NP_TABLE[(reg ^ cols[j]) & 0xFF] ^ (reg >> 8)
    lanes = (reg ^ 0xFFFFFFFF).tolist()
    shift = _x_pow_8n(step)
    tabs = [[_mulmod(shift, b << (8 * k)) for b in range(256)] for k in range(4)]
    crc = lanes[0]
    for c in lanes[1:]:
        crc = (tabs[0][crc & 0xFF] ^ tabs[1][(crc >> 8) & 0xFF] ^ tabs[2][(crc >> 16) & 0xFF]
               ^ tabs[3][crc >> 24] ^ c)
    return _crc_py(data[n:], crc)


def crc32c(data: bytes | np.ndarray) -> int:
    """crc32c of ``data``, as zeroio stores it (google_crc32c's value)."""
    try:
        import google_crc32c
    except ImportError:
        arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.view(np.uint8)
        return _crc_numpy(arr.reshape(-1))
    if isinstance(data, np.ndarray):
        data = data.view()
        data.flags.writeable = False  # google_crc32c reads a read-only buffer; not a copy
    return google_crc32c.value(data)


# -- the checkpoint -------------------------------------------------------------------------


def find_tag(ckpt: Path, tag: str | None) -> Path:
    """The tag folder to read: ``ckpt`` itself when it holds a manifest, else ``ckpt/tag``
    or the tag ``ckpt/latest`` names."""
    if tag is None and (ckpt / "manifest.json").is_file():
        return ckpt
    if tag is None:
        try:
            tag = (ckpt / "latest").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            raise RecoverError(f"{ckpt} has no readable 'latest' file and no manifest.json; pass the "
                               "checkpoint directory, a tag folder, or --tag") from None
    if not _NAME_RE.fullmatch(tag or "") or tag.startswith("."):
        raise RecoverError(f"tag {tag!r} is not one folder name")
    tdir = ckpt / tag
    if not (tdir / "manifest.json").is_file():
        raise RecoverError(f"{tdir} has no manifest.json: not a complete checkpoint (an "
                           "interrupted save?); pick another tag with --tag")
    return tdir


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([\[{])|[\]}]')  # a string, or a bracket


def read_json(path: Path):
    """A JSON file nested at most 100 deep, as zeroio's reader (jsonlimits.py) takes it."""
    try:
        text, depth = path.read_text(encoding="utf-8"), 0
        for m in _JSON_TOKEN.finditer(text):
            depth += 1 if m.group(1) else -1 if m.group()[0] != '"' else 0
            if depth > 100:
                raise RecoverError(f"{path}: nested deeper than 100 levels, not a zeroio file")
        return json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecoverError(f"cannot read {path}: {e}") from None


def _int(v, what: str, path: Path, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise RecoverError(f"{path}: {what} is {v!r}, not an integer >= {lo}; the manifest is damaged")
    return v


def read_manifest(tdir: Path) -> dict:
    """manifest.json, its version and crc checked; other keys are ignored."""
    path = tdir / "manifest.json"
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecoverError(f"{path} is not a zeroio checkpoint manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= READS_FORMAT_VERSION:
        raise RecoverError(f"{path}: format_version {version!r}; this script reads 1 to "
                           f"{READS_FORMAT_VERSION} (take recover.py from a newer zeroio)")
    if version >= 2:
        body = {k: v for k, v in doc.items() if k != MANIFEST_CRC_KEY}
        want = crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        if doc.get(MANIFEST_CRC_KEY) != want:
            raise RecoverError(f"{path}: its {MANIFEST_CRC_KEY} ({doc.get(MANIFEST_CRC_KEY)!r}) does not "
                               f"match its contents ({want}); the manifest is damaged or was edited")
    return doc


def parse_index(doc: dict, path: Path) -> tuple[list[tuple[str, int, tuple[int, ...]]], int]:
    """``[(name, offset, shape)]`` in model order, checked to tile [0, model.numel) exactly."""
    model = doc.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("index"), list):
        raise RecoverError(f"{path}: no model.index; the manifest is damaged")
    numel = _int(model.get("numel"), "model.numel", path)
    index, names = [], set()
    for item in model["index"]:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[2], list)) or item[0] in names:
            raise RecoverError(f"{path}: index entry {str(item)[:80]} is not a new [name, offset, shape]")
        names.add(item[0])
        shape = tuple(_int(d, f"a dimension of {item[0]!r}", path) for d in item[2])
        index.append((item[0], _int(item[1], f"the offset of {item[0]!r}", path), shape))
    pos = 0
    for name, off, shape in sorted(index, key=lambda e: (e[1], math.prod(e[2]))):
        if off != pos:
            raise RecoverError(f"{path}: the index does not tile the array ({name!r} starts at {off}, "
                               f"the entries before it end at {pos}); the manifest is damaged")
        pos += math.prod(shape)
    if pos != numel:
        raise RecoverError(f"{path}: the index covers {pos} elements, model.numel is {numel}")
    return index, numel


def parse_array(doc: dict, kind: str, numel: int, path: Path) -> dict:
    """Array ``kind`` of the manifest, checked: dtype, numel, and chunks with one crc each
    (or extents inside their files' checked bytes)."""
    a = (doc.get("arrays") or {}).get(kind)
    if not isinstance(a, dict) or a.get("dtype") not in _DTYPES:
        raise RecoverError(f"{path}: array {kind!r} has no known dtype (one of {sorted(_DTYPES)})")
    if _int(a.get("numel"), f"array {kind!r} numel", path) != numel:
        raise RecoverError(f"{path}: array {kind!r} has {a['numel']} elements, the index {numel}")
    itemsize = np.dtype(_DTYPES[a["dtype"]][0]).itemsize
    if a.get("layout") == "extents":
        return _parse_extents(a, kind, itemsize, path)
    ce = _int(a.get("chunk_elems"), f"array {kind!r} chunk_elems", path, lo=1)
    crcs = a.get("chunk_crc32c")
    count = -(-numel // ce)
    if not isinstance(crcs, list) or len(crcs) != count:
        raise RecoverError(f"{path}: array {kind!r} lists {len(crcs) if isinstance(crcs, list) else 0} "
                           f"chunk crcs for {count} chunks; the manifest is damaged")
    crcs = [_int(c, f"a chunk crc of {kind!r}", path) for c in crcs]
    return {"kind": kind, "dtype": a["dtype"], "numel": numel, "itemsize": itemsize,
            "chunk_elems": ce, "crcs": crcs, "extents": None}


def _parse_extents(a: dict, kind: str, itemsize: int, path: Path) -> dict:
    extents = a.get("extents")
    if not isinstance(extents, list):
        raise RecoverError(f"{path}: array {kind!r} has no extents list")
    out = []
    for e in extents:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
                and _EXTENT_RE.fullmatch(e[0]) and isinstance(e[3], list)):
            raise RecoverError(f"{path}: array {kind!r} extent {str(e)[:80]} is not "
                               "[file, crc_bytes, crc32c, spans]")
        crc_bytes = _int(e[1], f"crc_bytes of extent {e[0]}", path)
        for sp in e[3]:
            if not (isinstance(sp, list) and len(sp) == 3):
                raise RecoverError(f"{path}: extent {e[0]} span {sp!r} is not [at, offset, n]")
            at, _off, n = (_int(v, f"a span of extent {e[0]}", path) for v in sp)
            if (at + n) * itemsize > crc_bytes:
                raise RecoverError(f"{path}: extent {e[0]} span {sp} runs past its {crc_bytes} checked bytes")
        out.append((e[0], crc_bytes, _int(e[2], f"the crc of extent {e[0]}", path)))
    return {"kind": kind, "dtype": a["dtype"], "itemsize": itemsize, "extents": out}


def _zarr_metadata(info: dict) -> dict:
    """What the array's zarr.json must say, given the manifest (the keys that decide its bytes)."""
    if info["extents"] is not None:  # a zarr group naming the layout ([Note: shared extents])
        return {"zarr_format": 3, "node_type": "group",
                "attributes": {"zeroio": {"layout": "extents", "dtype": info["dtype"]}}}
    return {"zarr_format": 3, "node_type": "array", "shape": [info["numel"]],
            "data_type": _DTYPES[info["dtype"]][1],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [info["chunk_elems"]]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}


def check_zarr_json(tdir: Path, info: dict, manifest: Path) -> None:
    """The array's zarr.json agrees with the manifest (a reader that trusts it would read a
    different shape, dtype or byte order)."""
    path = tdir / info["kind"] / "zarr.json"
    have = read_json(path)
    for key, value in _zarr_metadata(info).items():
        got = have.get(key) if isinstance(have, dict) else None
        if got != value:
            raise RecoverError(f"{path}: {key} is {json.dumps(got)}, the manifest {manifest} implies "
                               f"{json.dumps(value)}; the array metadata is damaged or was edited "
                               "(restore it, or load another tag)")


def read_checked(path: Path, nbytes: int, crc: int, exact: bool = True) -> np.ndarray:
    """The first ``nbytes`` of ``path`` as uint8, after checking its size (before reading a
    byte, so a huge or short file costs nothing) and then its crc32c."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise RecoverError(f"{path} is missing (the manifest lists it); restore it or pick "
                           "another tag with --tag") from None
    if size < nbytes or (exact and size != nbytes):
        what = "truncated" if size < nbytes else "larger than the manifest says"
        raise RecoverError(f"{path} is {what}: {size} bytes, the manifest says {nbytes}; "
                           "restore it or pick another tag with --tag")
    try:
        with open(path, "rb") as f:
            data = np.fromfile(f, dtype=np.uint8, count=nbytes)
    except OSError as e:
        raise RecoverError(f"{path}: reading it failed: {e.strerror or e}") from None
    if data.size != nbytes:
        raise RecoverError(f"{path}: read {data.size} of {nbytes} bytes")
    got = crc32c(data)
    if got != crc:
        raise RecoverError(f"{path}: crc32c mismatch ({got:#010x}, the manifest recorded {crc:#010x}); "
                           "the file is damaged: restore it or pick another tag with --tag")
    return data


def chunks(tdir: Path, info: dict):
    """(chunk index, its elements as stored), each checked, in order."""
    nbytes = info["chunk_elems"] * info["itemsize"]
    for i, crc in enumerate(info["crcs"]):
        data = read_checked(tdir / info["kind"] / "c" / str(i), nbytes, crc)
        yield i, data.view(_DTYPES[info["dtype"]][0])


def verify_array(tdir: Path, info: dict, manifest: Path) -> None:
    """Every file of one array present, of its size and crc (``--verify``: all arrays)."""
    check_zarr_json(tdir, info, manifest)
    if info["extents"] is None:
        for _ in chunks(tdir, info):
            pass
        return
    for name, crc_bytes, crc in info["extents"]:
        read_checked(tdir / info["kind"] / "x" / name, crc_bytes, crc, exact=False)


# -- casting and safetensors ----------------------------------------------------------------


def _to_bf16_bits(x: np.ndarray, nan_bits: int) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even, every NaN as ``nan_bits``."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
    out[np.isnan(x)] = nan_bits
    return out


def _to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16, rounded to nearest even; a NaN quieted with its payload's top bits
    kept, as torch's (hardware) cast does (numpy keeps a signalling NaN signalling)."""
    out = x.astype("<f2")
    nan = np.isnan(x)
    if nan.any():
        u = np.ascontiguousarray(x[nan], dtype="<f4").view("<u4")
        out.view("<u2")[nan] = (((u >> 16) & 0x8000) | 0x7E00 | ((u & 0x7FFFFF) >> 13)).astype("<u2")
    return out


def convert(values: np.ndarray, stored: str, target: str) -> np.ndarray:
    """Stored elements (16-bit floats as uint16 bits) cast from ``stored`` to ``target``
    (torch dtype names) as torch casts a CPU tensor, which `zeroio consolidate` does; the
    result's bytes are the safetensors bytes. NaNs follow torch's casts too: float32 ->
    bfloat16 writes 0xFFFF (its vectorized cast), float16 -> bfloat16 0x7FC0, float16 ->
    float32 quiets a signalling NaN."""
    if stored == target:
        return values
    if stored == "bfloat16":
        f32 = (values.astype("<u4") << 16).view("<f4")
    elif stored == "float16":
        f32 = values.view("<f2").astype("<f4")
        f32.view("<u4")[np.isnan(f32)] |= 0x400000
    else:
        f32 = values.astype("<f4")
    if target == "float32":
        return f32
    if target == "bfloat16":
        return _to_bf16_bits(f32, 0x7FC0 if stored == "float16" else 0xFFFF)
    if target == "float16":
        return _to_f16(f32)
    raise RecoverError(f"cannot write dtype {target}")


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], itemsize: int,
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Model-order runs of at most ``max_shard_bytes`` (a larger tensor alone), as zeroio's."""
    shards, cur, size = [], [], 0
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def _header(shard, st_dtype: str, itemsize: int) -> tuple[bytes, dict[str, int]]:
    """safetensors.torch.save_file's header for ``shard``, and each tensor's byte offset."""
    doc: dict = {"__metadata__": {"format": "pt"}}
    at, starts = 0, {}
    for name, shape in sorted(shard, key=lambda s: s[0]):
        nbytes = math.prod(shape) * itemsize
        doc[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        starts[name] = at
        at += nbytes
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    base = 8 + len(head)
    return len(head).to_bytes(8, "little") + head, {n: base + a for n, a in starts.items()}


def write_export(tdir: Path, info: dict, index, target: str, max_shard_bytes: int,
                 staging: Path, hf_config) -> list[str]:
    """The safetensors folder's files in ``staging``: chunks read once, front to back, each
    tensor's part written at its place in its file. The names written."""
    itemsize = np.dtype(_DTYPES[target][0]).itemsize
    shards = plan_shards([(n, s) for n, _, s in index], itemsize, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    files, place = {}, {}
    try:
        for fname, shard in zip(names, shards, strict=True):
            head, starts = _header(shard, _DTYPES[target][2], itemsize)
            f = files[fname] = open(staging / fname, "wb")  # noqa: SIM115 - closed below
            f.write(head)
            place.update({n: (f, starts[n]) for n, _ in shard})
        runs = sorted((off, math.prod(s), n) for n, off, s in index if math.prod(s))
        ce, first = info["chunk_elems"], 0
        for c, data in chunks(tdir, info):
            base, end = c * ce, (c + 1) * ce
            while first < len(runs) and runs[first][0] + runs[first][1] <= base:
                first += 1
            r = first
            while r < len(runs) and runs[r][0] < end:
                off, n, name = runs[r]
                lo, hi = max(off, base), min(off + n, end)
                f, start = place[name]
                f.seek(start + (lo - off) * itemsize)
                f.write(np.ascontiguousarray(convert(data[lo - base: hi - base], info["dtype"], target)))
                r += 1
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    written = list(names)
    if len(shards) > 1:
        total = sum(math.prod(s) * itemsize for _, _, s in index)
        weight_map = {n: fname for fname, shard in zip(names, shards, strict=True) for n, _ in shard}
        _write_text(staging / "model.safetensors.index.json",
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        written.append("model.safetensors.index.json")
    if hf_config:
        cfg = dict(hf_config)
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = target
        _write_text(staging / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    return written


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# -- replacing an export ([Note: replacing an export] in zeroio/io/export_dir.py) -------------

_EXPORT_FILE = re.compile(r"^(model\.safetensors|model\.safetensors\.index\.json|"
                          r"model-[0-9]{5}-of-[0-9]{5}\.safetensors)$")
_ENTRY_POINTS = ("model.safetensors", "model.safetensors.index.json")


def staging_dir(out: Path) -> Path:
    """A fresh hidden folder beside ``out``, on its file system (renames stay atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not out.is_dir():
        raise RecoverError(f"{out} exists and is not a folder; pass a folder for the export")
    path = out.parent / f".{out.name}.zeroio-export-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def publish(staging: Path, out: Path, names: list[str]) -> None:
    """Move the complete export in ``staging`` into ``out``: one rename into a new folder;
    into an existing one, the earlier export's files (those zeroio names, never others) go
    first, entry points first, then the new files come in, entry point last."""
    if not out.exists():
        os.rename(staging, out)
        _fsync_dir(out.parent)
        return
    old = sorted((p.name for p in out.iterdir() if _EXPORT_FILE.fullmatch(p.name) and p.is_file()),
                 key=lambda n: n not in _ENTRY_POINTS)
    for name in old:
        os.unlink(out / name)
    entry = [n for n in names if n in _ENTRY_POINTS]
    for name in [n for n in names if n not in _ENTRY_POINTS] + entry:
        os.replace(staging / name, out / name)
    _fsync_dir(out)
    shutil.rmtree(staging, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the command ----------------------------------------------------------------------------


def recover(ckpt: str | os.PathLike, out: str | os.PathLike, *, tag: str | None = None,
            dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
            verify: bool = False) -> list[Path]:
    """Write checkpoint ``ckpt`` (tag ``tag``) as a safetensors folder ``out``; the files.
    ``verify``: every array of the tag (moments too) is checked before anything is written."""
    tdir = find_tag(Path(ckpt), tag)
    mpath = tdir / "manifest.json"
    doc = read_manifest(tdir)
    index, numel = parse_index(doc, mpath)
    arrays = doc.get("arrays")
    if not isinstance(arrays, dict):
        raise RecoverError(f"{mpath}: no arrays; the manifest is damaged")
    for name in arrays:  # each becomes a folder name below
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith("."):
            raise RecoverError(f"{mpath}: array name {name!r} is not one folder name")
    kind = next((k for k in WEIGHT_KINDS if k in arrays), None)
    if kind is None:
        raise RecoverError(f"{mpath}: no weights array ({' or '.join(WEIGHT_KINDS)}); it has {sorted(arrays)}")
    info = parse_array(doc, kind, numel, mpath)
    if info["extents"] is not None:
        raise RecoverError(f"{mpath}: weights array {kind!r} is stored as extents, which zeroio never "
                           "writes for weights; the manifest is damaged")
    target = _DTYPE_ARG[dtype] if dtype else info["dtype"]
    if verify:
        for k in arrays:
            verify_array(tdir, parse_array(doc, k, numel, mpath), mpath)
    check_zarr_json(tdir, info, mpath)
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    outdir = Path(out)
    staging = staging_dir(outdir)
    try:
        names = write_export(tdir, info, index, target, max_shard_bytes, staging, meta.get("hf_config"))
        publish(staging, outdir, names)
    except OSError as e:  # a write, not a read (reads are RecoverErrors naming the chunk)
        where = e.filename or staging
        raise RecoverError(f"{where}: writing the export failed: {e.strerror or e}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return [outdir / n for n in names]


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
                   help="check every array of the tag (moments too) before writing; the weights "
                        "are always checked")
    args = p.parse_args(argv)
    if args.max_shard_size < 1:
        p.error(f"--max-shard-size must be >= 1, got {args.max_shard_size}")
    try:
        files = recover(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype,
                        max_shard_bytes=args.max_shard_size, verify=args.verify)
    except (RecoverError, OSError) as e:  # an OSError names its file; nothing was published
        print(f"recover: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} file(s) to {args.out}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
