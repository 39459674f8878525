"""Degenerate sizes and counts: a ConfigError naming the key and the valid range where
DeepSpeed defines no behaviour for them, accepted where it does (its reading followed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroio.config import load_config
from zeroio.errors import ConfigError
from zeroio.optim.swap_plan import MAX_SUB_GROUPS, split

Z = "zero_optimization"
NVME = {"device": "nvme", "nvme_path": "/tmp/zeroio-unused"}

# (id, config, key path expected on the error, text expected in the message)
DEGENERATE = [
    ("sub-group-zero", {Z: {"stage": 3, "sub_group_size": 0, "offload_optimizer": NVME}},
     f"{Z}.sub_group_size", "an integer >= 1"),
    ("sub-group-negative", {Z: {"sub_group_size": -5}}, f"{Z}.sub_group_size", "1e9 is the default"),
    ("allgather-zero", {Z: {"stage": 2, "allgather_bucket_size": 0}}, f"{Z}.allgather_bucket_size",
     "an integer >= 1"),
    ("reduce-negative", {Z: {"reduce_bucket_size": -1}}, f"{Z}.reduce_bucket_size", ">= 0"),
    ("prefetch-negative", {Z: {"stage3_prefetch_bucket_size": -1}}, f"{Z}.stage3_prefetch_bucket_size",
     ">= 0"),
    ("live-negative", {Z: {"stage3_max_live_parameters": -1}}, f"{Z}.stage3_max_live_parameters", ">= 0"),
    ("reuse-negative", {Z: {"stage3_max_reuse_distance": -1}}, f"{Z}.stage3_max_reuse_distance", ">= 0"),
    ("persistence-negative", {Z: {"stage3_param_persistence_threshold": -1}},
     f"{Z}.stage3_param_persistence_threshold", ">= 0"),
    ("optimizer-buffers-negative", {Z: {"offload_optimizer": {"buffer_count": -1}}},
     f"{Z}.offload_optimizer.buffer_count", ">= 0"),
    ("param-buffers-negative", {Z: {"offload_param": {"buffer_count": -1}}},
     f"{Z}.offload_param.buffer_count", ">= 0"),
    ("param-buffer-size-negative", {Z: {"offload_param": {"buffer_size": -1}}},
     f"{Z}.offload_param.buffer_size", ">= 0"),
    ("max-in-cpu-negative", {Z: {"offload_param": {"max_in_cpu": -1}}}, f"{Z}.offload_param.max_in_cpu",
     ">= 0"),
    ("prefetch-depth-negative", {Z: {"tiering": {"prefetch_depth": -1}}}, f"{Z}.tiering.prefetch_depth",
     ">= 0"),
    ("step-chunk-zero", {Z: {"tiering": {"step_chunk_numel": 0}}}, f"{Z}.tiering.step_chunk_numel", ">= 1"),
    ("cpu-budget-negative", {Z: {"tiering": {"cpu_budget_bytes": -1}}}, f"{Z}.tiering.cpu_budget_bytes",
     ">= 0"),
    ("aio-block-zero", {"aio": {"block_size": 0}}, "aio.block_size", "> 0 and <= 1073741824"),
    ("aio-block-unaligned", {"aio": {"block_size": 1000}}, "aio.block_size", "a multiple of 4096"),
    ("aio-block-huge", {"aio": {"block_size": 1 << 40}}, "aio.block_size", "<= 1073741824"),
    ("aio-queue-zero", {"aio": {"queue_depth": 0}}, "aio.queue_depth", "> 0 and <= 1024"),
    ("aio-queue-huge", {"aio": {"queue_depth": 4096}}, "aio.queue_depth", "at most 1024"),
    ("aio-threads-zero", {"aio": {"thread_count": 0}}, "aio.thread_count", "> 0 and <= 256"),
    ("aio-threads-huge", {"aio": {"intra_op_parallelism": 100_000}}, "aio.intra_op_parallelism", "<= 256"),
    ("aio-call-too-big", {"aio": {"block_size": 64 << 20, "queue_depth": 32}}, "aio.queue_depth",
     "67108864 x 32 = 2147483648 bytes per I/O call"),
]


@pytest.mark.parametrize("raw,key,text", [d[1:] for d in DEGENERATE], ids=[d[0] for d in DEGENERATE])
def test_degenerate_size_is_a_config_error_naming_key_and_range(raw, key, text):
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    message = str(e.value)
    assert e.value.key == key, (e.value.key, message)
    assert key.split(".")[-1] in message and text in message, message


# DeepSpeed defines these (its schema takes >= 0, and its code reads 0 as below): accepted
ACCEPTED = [
    ({Z: {"stage": 2, "reduce_bucket_size": 0}}, f"{Z}.reduce_bucket_size", 0),  # each gradient alone
    ({Z: {"stage": 3, "stage3_prefetch_bucket_size": 0}}, f"{Z}.stage3_prefetch_bucket_size", 0),
    ({Z: {"stage": 3, "stage3_max_live_parameters": 0}}, f"{Z}.stage3_max_live_parameters", 0),
    ({Z: {"stage": 3, "stage3_param_persistence_threshold": 0}},
     f"{Z}.stage3_param_persistence_threshold", 0),
    ({Z: {"offload_optimizer": {"buffer_count": 0}}}, f"{Z}.offload_optimizer.buffer_count", 0),
    ({Z: {"tiering": {"prefetch_depth": 0}}}, f"{Z}.tiering.prefetch_depth", 0),  # demand only
    ({"aio": {"block_size": 1 << 30, "queue_depth": 1, "thread_count": 256}}, "aio.block_size", 1 << 30),
    ({"aio": {"block_size": 4096, "queue_depth": 1024}}, "aio.queue_depth", 1024),
    ({"aio": {"block_size": 64 << 20, "queue_depth": 32, "single_submit": True}}, "aio.queue_depth", 32),
]


@pytest.mark.parametrize("raw,key,value", ACCEPTED, ids=[a[1] + f"={a[2]}" for a in ACCEPTED])
def test_sizes_deepspeed_defines_are_accepted(raw, key, value):
    cfg = load_config(raw)
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    assert obj == value


def _groups(*numels: int):
    return [SimpleNamespace(group_index=i, padded_numel=n) for i, n in enumerate(numels)]


def test_too_many_sub_groups_is_a_config_error_before_any_is_made():
    # 8e9 elements in sub-groups of one element would be 8e9 swap array pairs: refused at once
    with pytest.raises(ConfigError) as e:
        split(_groups(8_000_000_000), 1)
    assert e.value.key == f"{Z}.sub_group_size"
    need = -(-8_000_000_000 // MAX_SUB_GROUPS)
    assert f"sub_group_size >= {need}" in str(e.value) and "8000000000 sub-groups" in str(e.value)
    # at the bound it splits, by hand: ceil(n / size) sub-groups per group
    subs = split(_groups(8_000_000_000), need)
    assert len(subs) == -(-8_000_000_000 // need) <= MAX_SUB_GROUPS
    assert [s.numel for s in split(_groups(10, 3), 4)] == [4, 4, 2, 3]
