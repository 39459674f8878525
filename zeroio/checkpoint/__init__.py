"""Sharded checkpoints: zarr v3 flat arrays in global order, atomic tags, any-world-size resume.

    save_sharded(state, dir, tag)         collective: each rank writes its segments
    load_sharded(dir, tag, template)      each rank fills its own ranges
    consolidate(dir, tag=None)            {name: full tensor}, for safetensors export
    engine_io.save_checkpoint / load_checkpoint, export16.save_16bit_model   (used by Engine)

See docs/checkpoint.md for the on-disk layout.
"""

from __future__ import annotations

from zeroio.checkpoint.comm import Comm
from zeroio.checkpoint.consolidate import consolidate, write_folder, write_safetensors
from zeroio.checkpoint.layout import FORMAT_VERSION, CheckpointWarning, Manifest, read_manifest
from zeroio.checkpoint.reader import ArrayReader, LoadResult, ShardedLoad, load_sharded, resolve_tag
from zeroio.checkpoint.state import LazySegment, ParamEntry, Segment, ShardedState, build_index
from zeroio.checkpoint.tags import TagStatus, check_tag, scan_tags
from zeroio.checkpoint.writer import SaveOptions, save_sharded

__all__ = [
    "ArrayReader",
    "CheckpointWarning",
    "Comm",
    "FORMAT_VERSION",
    "LoadResult",
    "Manifest",
    "ParamEntry",
    "SaveOptions",
    "ShardedLoad",
    "TagStatus",
    "check_tag",
    "LazySegment",
    "Segment",
    "ShardedState",
    "build_index",
    "consolidate",
    "load_sharded",
    "read_manifest",
    "resolve_tag",
    "save_sharded",
    "scan_tags",
    "write_folder",
    "write_safetensors",
]
