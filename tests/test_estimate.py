"""estimate_memory against the ZeRO paper's figure 1 and hand computations; the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import zeroio
from zeroio.config import load_config
from zeroio.errors import ConfigError
from zeroio.estimate import estimate_memory, parse_count

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


# ZeRO paper, figure 1: Psi = 7.5B, Nd = 64, K = 12, mixed-precision Adam.
@pytest.mark.parametrize("stage,paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_reproduces_zero_paper_figure_1(stage, paper_gb):
    r = estimate_memory(7.5e9, gpus_per_node=8, nodes=8, stage=stage, dtype="fp16",
                        zeroio_buffers=False)
    assert r.world_size == 64
    assert round(r.gpu_bytes_per_gpu / GB, 1) == paper_gb
    # and the exact formulas behind the rounded figures
    psi, nd = 7.5e9, 64
    exact = {0: 16 * psi, 1: 4 * psi + 12 * psi / nd, 2: 2 * psi + 14 * psi / nd,
             3: 16 * psi / nd}[stage]
    assert r.gpu_bytes_per_gpu == pytest.approx(exact, abs=64)
    assert r.model_state_gpu_bytes_per_gpu == r.gpu_bytes_per_gpu
    assert r.cpu_bytes_per_node == 0 and r.nvme_bytes_per_node == 0


def test_model_states_keep_the_paper_accounting_beside_zeroio_buffers():
    """Figure 1's stage-3 column (16 bytes per parameter over N = 1.9 GB at 7.5B, 64 GPUs)
    in the model-state figures with zeroio's buffers on: the fp32 gradient shard zeroio
    holds counts its paper's 2 bytes there and the other 2 as a buffer."""
    psi, nd = 7.5e9, 64
    r = estimate_memory(psi, gpus_per_node=8, nodes=8, stage=3, dtype="fp16")
    assert r.model_state_gpu_bytes_per_gpu == pytest.approx(16 * psi / nd, abs=64)
    assert round(r.model_state_gpu_bytes_per_gpu / GB, 1) == 1.9
    bare = estimate_memory(psi, gpus_per_node=8, nodes=8, stage=3, dtype="fp16",
                           zeroio_buffers=False)
    extra = {i.name: i.bytes_per_gpu for i in r.items if i.kind == "zeroio_buffer"}
    assert extra["fp32 gradient shard beyond the model states'"] == pytest.approx(
        2 * psi / nd, abs=64)
    assert r.model_state_gpu_bytes_per_gpu == bare.gpu_bytes_per_gpu
    for stage in (1, 2):  # the lower stages already kept it
        a = estimate_memory(psi, gpus_per_node=8, nodes=8, stage=stage, dtype="fp16")
        b = estimate_memory(psi, gpus_per_node=8, nodes=8, stage=stage, dtype="fp16",
                            zeroio_buffers=False)
        assert a.model_state_gpu_bytes_per_gpu == b.gpu_bytes_per_gpu


def test_top_level_export_and_parse_count():
    assert zeroio.estimate_memory is estimate_memory
    assert [parse_count(s) for s in ("7.5e9", "1.4B", "350M", "125k", "2T", "1000", 3e6)] == [
        7_500_000_000, 1_400_000_000, 350_000_000, 125_000, 2_000_000_000_000, 1000, 3_000_000]
    for bad in ("", "x", "1.4Q", "-5", "0"):
        with pytest.raises(ConfigError):
            parse_count(bad)


# Hand computations, Psi = 1e9, N = 8 GPUs on one node, bf16 (b = 2), K = 12.
# Model states only (no zeroio buffers): (gpu per GPU, cpu per node, nvme per node).
PSI, N = 1_000_000_000, 8
SHARD = PSI // N
HAND = [
    # stage 1 + cpu: GPU keeps 2Psi params + 2Psi grads; CPU gets K Psi/N + 2 Psi/N grad shard.
    (1, "cpu", "none", (2 * PSI + 2 * PSI, N * (12 + 2) * SHARD, 0)),
    # stage 2 + cpu: GPU keeps 2Psi params; grads shard and optimizer to CPU.
    (2, "cpu", "none", (2 * PSI, N * (2 + 12) * SHARD, 0)),
    # stage 2 + nvme: optimizer state to NVMe, gradient shard in CPU memory.
    (2, "nvme", "none", (2 * PSI, N * 2 * SHARD, N * 12 * SHARD)),
    # stage 3 + optimizer cpu: GPU keeps the 2 Psi/N parameter shard.
    (3, "cpu", "none", (2 * SHARD, N * 14 * SHARD, 0)),
    # stage 3 + everything on CPU.
    (3, "cpu", "cpu", (0, N * 16 * SHARD, 0)),
    # stage 3 + parameters on CPU only.
    (3, "none", "cpu", ((2 + 12) * SHARD, N * 2 * SHARD, 0)),
    # ZeRO-Infinity: both on NVMe, gradients in CPU memory.
    (3, "nvme", "nvme", (0, N * 2 * SHARD, N * 14 * SHARD)),
    (3, "nvme", "cpu", (0, N * 4 * SHARD, N * 12 * SHARD)),
    (3, "cpu", "nvme", (0, N * 14 * SHARD, N * 2 * SHARD)),
]


@pytest.mark.parametrize("stage,opt,par,expected", HAND,
                         ids=[f"s{h[0]}-opt_{h[1]}-param_{h[2]}" for h in HAND])
def test_offload_modes_match_hand_computation(stage, opt, par, expected):
    r = estimate_memory(PSI, gpus_per_node=N, stage=stage, offload_optimizer=opt,
                        offload_param=par, zeroio_buffers=False)
    assert (r.gpu_bytes_per_gpu, r.cpu_bytes_per_node, r.nvme_bytes_per_node) == expected
    if stage >= 2:  # from stage 2 offloading only moves bytes between tiers
        base = estimate_memory(PSI, gpus_per_node=N, stage=stage, zeroio_buffers=False)
        moved = r.gpu_bytes_per_gpu + (r.cpu_bytes_per_node + r.nvme_bytes_per_node) // N
        assert moved == base.gpu_bytes_per_gpu


def test_zeroio_buffers_hand_computation_nvme(monkeypatch):
    # Psi = 1e9, 2 GPUs x 2 nodes, bf16, zero3-nvme.json (bucket 5e8, overlap on, max live 1e9,
    # sub_group 1e9, optimizer buffer_count 4, param buffer_count 5 x buffer_size 1e8, gas 1).
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)  # auto: the 2.5e8 shard compiles
    cfg = load_config(ROOT / "configs" / "zero3-nvme.json")
    r = estimate_memory(PSI, gpus_per_node=2, nodes=2, config=cfg)
    shard = PSI // 4
    # stage 3 reduces one group in fp32 (reduce_bucket_size stands in for the unknown group
    # size G = 5e8): two fp32 buckets + autograd's bf16 gradients of one group; live params
    # max_live + G capped at Psi, and each gathered group's shard copied in: with the NVMe
    # optimizer params_from_master "auto" is on, so that is the fp32 master (4 bytes)
    gpu = 2 * 4 * 500_000_000 + 2 * 500_000_000 + 2 * PSI + 4 * PSI // 4
    # gas 1 and the one-pass CPU Adam stepping the swapped pieces: the host gradient shard is
    # bf16 (shard/host_grads.py), the model states' 2-byte term, nothing beyond it
    cpu = 2 * shard + 4 * shard + 4 * shard * 4 + min(5 * 100_000_000 * 2, 2 * shard)
    #     bf16 grads  fp32 masters  opt swap buffers  param swap buffers, at most the shards'
    #                                                 bytes (the store's ask: nvme_store.py)
    # the moments (the masters stay on the host); the parameters' 2 B/param home, the paper's
    # term, is cancelled by params_from_master's negative item
    nvme = 8 * shard
    assert (r.stage, r.offload_optimizer, r.offload_param, r.dtype) == (3, "nvme", "nvme", "bf16")
    assert r.gpu_bytes_per_gpu == gpu
    assert r.cpu_bytes_per_node == 2 * cpu
    assert r.nvme_bytes_per_node == 2 * nvme


def test_zeroio_buffers_hand_computation_stage2_small_model():
    # A model smaller than the buckets: buckets are capped at Psi.
    psi = 10_000_000
    r = estimate_memory(psi, gpus_per_node=2, stage=2, dtype="fp16")
    shard = psi // 2
    model = 2 * psi + 2 * shard + 12 * shard
    buffers = 4 * shard + 1 * 2 * psi + 2 * psi  # fp32 grads, 1 reduce bucket, all-gather
    assert r.gpu_bytes_per_gpu == model + buffers
    fp32 = estimate_memory(psi, gpus_per_node=2, stage=2, dtype="fp32")
    assert fp32.gpu_bytes_per_gpu == 4 * psi + 4 * shard + 12 * shard + 4 * psi + 4 * psi


@pytest.mark.parametrize("kwargs,key", [
    (dict(stage=2, offload_param="cpu"), "offload_param"),
    (dict(stage=0, offload_optimizer="cpu"), "offload_optimizer"),
    (dict(stage=5), "stage"),
    (dict(stage=3, dtype="int8"), "dtype"),
    (dict(stage=3, offload_optimizer="disk"), "offload_optimizer"),
    (dict(stage=3, gpus_per_node=0), "gpus_per_node"),
])
def test_bad_arguments_are_config_errors(kwargs, key):
    with pytest.raises(ConfigError) as e:
        estimate_memory(1e9, **kwargs)
    assert e.value.key == key


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "zeroio.cli", "estimate", *args], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.mark.parametrize("mode,grad_bytes", [("auto", 2), ("torch", 4)])
def test_cli_json_output(monkeypatch, mode, grad_bytes):
    """Per node: optimizer state and the host gradient shard, which is the fp16 gradient
    partition itself (one shard, as the partitioner allocates it): 2 bytes under the one-pass
    CPU Adam (``auto``, the default: the 117M-element shard is above its threshold), 4 under
    torch's kernel (the partition's 2 and 2 beyond it); and the host step's 4 pinned fp16
    slots of one 64M-element chunk (4 with the step assist: [Note: step publication])."""
    monkeypatch.setenv("ZEROIO_CPU_ADAM", mode)  # the CLI's process inherits it
    out = _cli("--params", "7.5B", "--gpus-per-node", "8", "--nodes", "8", "--stage", "2",
               "--offload-optimizer", "cpu", "--dtype", "fp16", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    r = estimate_memory(7.5e9, 8, 8, stage=2, offload_optimizer="cpu", dtype="fp16")
    assert d == r.to_dict()
    assert d["gpu_bytes_per_gpu"] == r.gpu_bytes_per_gpu
    assert d["cpu_bytes_per_node"] == 8 * ((12 + grad_bytes) * (7_500_000_000 // 64) +
                                           4 * 2 * (1 << 26))
    assert d["nvme_bytes_per_node"] == 0
    paper = json.loads(_cli("--params", "7.5e9", "--gpus-per-node", "64", "--stage", "1",
                            "--no-buffers", "--json").stdout)
    assert round(paper["gpu_bytes_per_gpu"] / GB, 1) == 31.4


def test_cli_table_and_error():
    out = _cli("--params", "1.4B", "--gpus-per-node", "2", "--config", "configs/zero3-nvme.json")
    assert out.returncode == 0 and "NVMe space per node" in out.stdout
    bad = _cli("--params", "lots", "--gpus-per-node", "2", "--stage", "3")
    assert bad.returncode == 2 and "parameter count" in bad.stderr


def test_cli_ratio_matches_the_library():
    args = ("--params", "13B", "--stage", "3", "--offload-optimizer", "cpu",
            "--offload-param", "cpu", "--dtype", "bf16", "--json")
    half = _cli(*args, "--ratio", "0.5")
    assert half.returncode == 0, half.stderr
    d = json.loads(half.stdout)
    r = estimate_memory(13e9, stage=3, offload_optimizer="cpu", offload_param="cpu",
                        dtype="bf16", ratio=0.5)
    assert d == r.to_dict()
    full = json.loads(_cli(*args).stdout)
    assert d["gpu_bytes_per_gpu"] > full["gpu_bytes_per_gpu"]
    assert d["cpu_bytes_per_node"] < full["cpu_bytes_per_node"]


def test_stage3_ratio_buffers_by_hand():
    """What zeroio's stage 3 allocates with offload_param cpu, optimizer cpu, ratio 0.25, a known
    layer size, activations and gradient accumulation (partitioner.py, grads.py, twin.py)."""
    psi, group, act = 1_000_000_000, 50_000_000, 7_000_000_000
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                       "bf16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                             "offload_optimizer": {"device": "cpu",
                                                                   "ratio": 0.25}}})
    r = estimate_memory(psi, config=cfg, largest_group=group, activation_bytes=act)
    dev = 750_000_000  # floor(0.75 * Psi) elements stepped on the GPU
    gpu = (16 * dev                     # fp32 master + moments (12) and fp32 gradient (4)
           + 2 * 4 * group + 2 * group  # two fp32 group buckets, bf16 autograd gradients
           + 2 * 2 * psi                # live params (max_live + G, capped at Psi), shard copies
           + 2 * (1 << 26)              # publish staging of the device side's bf16 values
           + 4 * (1 << 24) * (16 + 2)   # step assist: 4 slots of fp32 master, moments and
           + act)                       # gradient (fp32 host gradients), the bf16 shard copy
    # bf16 shards, state, and the accumulation's staging: 3 pinned fp32 slots of one group
    # ([Note: bounded staging] in partition/landing.py)
    host = 2 * psi + 16 * (psi - dev) + 4 * 3 * group
    assert r.gpu_bytes_per_gpu == gpu
    assert r.cpu_bytes_per_node == host
    assert r.to_dict()["activations"] == act
    # no 16-bit gradient shard is held: the paper's 2-byte term is a model state and the fp32
    # shard's other 2 bytes per element are a buffer, summing to the 4 above
    grads = {i.name: i for i in r.items if "gradient" in i.name and "shard" in i.name
             or i.name.startswith("gradients")}
    assert sum(i.bytes_per_gpu for i in grads.values()) == 4 * psi
    assert {i.kind for n, i in grads.items() if n.startswith("gradients")} == {"model_state"}
    # without zeroio buffers the ZeRO paper's terms stay, 16-bit gradients included
    paper = estimate_memory(psi, config=cfg, zeroio_buffers=False)
    assert paper.gpu_bytes_per_gpu == (12 + 2) * dev
    assert paper.cpu_bytes_per_node == 2 * psi + (12 + 2) * (psi - dev)


@pytest.mark.parametrize("mode", ["compiled", "auto", "torch"])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_host_gradients_by_hand(monkeypatch, stage, ratio, mode):
    """Stages 1/2, optimizer on cpu, bf16, gas 1 (shard/host_grads.py): the host gradient
    shard is 2 bytes per host element under the one-pass CPU Adam (``auto``: the 100M-element
    host part is above its threshold), 4 under torch's kernel; with a ratio the device side's
    stays 4 bytes on the GPU. One shard each, as the partitioner allocates them: the model
    states' 2-byte gradient partition and what the shard holds beyond it. Every byte by hand
    (no config: 5e8-element buckets, one reduce bucket below stage 3; no device room: the
    gradient is planned in host memory, [Note: the gradient's home])."""
    monkeypatch.setenv("ZEROIO_CPU_ADAM", mode)
    psi, n = 800_000_000, 4
    shard = psi // n                       # 200M
    dev = int(shard * (1 - ratio))         # 0 or 100M stay on the GPU
    host = shard - dev
    g = 4 if mode == "torch" else 2
    r = estimate_memory(psi, gpus_per_node=n, stage=stage, offload_optimizer="cpu",
                        dtype="bf16", ratio=ratio)
    gpu = (2 * psi                         # bf16 parameters
           + (2 * psi if stage == 1 else 0)  # stage 1: the replicated bf16 gradients
           + (12 + 4) * dev                # device side: state, fp32 gradient shard
           + 2 * 500_000_000               # one reduce bucket (bf16)
           + 2 * 500_000_000               # all-gather bucket
           # step assist ("auto", any world): 4 slots of 16M elements, fp32 master, moments
           # and gradient (16 B), + the 16-bit host gradient's landing (2 B) when it is 16-bit
           + 4 * (1 << 24) * (16 + (2 if g == 2 else 0)))
    cpu = ((12 + g) * host                 # state, host gradient shard
           + 4 * 2 * min(1 << 26, host))   # the step's pinned bf16 slots (4: the assist)
    assert r.gpu_bytes_per_gpu == gpu
    assert r.cpu_bytes_per_node == n * cpu
    part = "gradient shard for the CPU optimizer" if stage == 1 else "gradients"
    grads = {(i.name, i.tier): i.bytes_per_gpu for i in r.items
             if "gradient shard" in i.name or i.name.startswith("gradients (")
             or (i.name == "gradients" and stage == 2)}
    want = {(part, "cpu"): 2 * host}
    if g == 4:
        want[("fp32 gradient shard beyond the model states'", "cpu")] = 2 * host
    if dev:
        want[(f"{part} (ratio: on GPU)", "gpu")] = 2 * dev
        want[("fp32 gradient shard beyond the model states' (ratio: on GPU)", "gpu")] = 2 * dev
    assert grads == want


@pytest.mark.parametrize("stage,gas,opt,dtype", [
    (2, 2, "cpu", "bf16"),   # stage 2 sums micro steps on the host, in fp32
    (2, 2, "nvme", "bf16"),  # the same with nvme's swapper
    (2, 1, "cpu", "fp32"),   # fp32 training: the gradient is fp32 anyway
])
def test_stage12_fp32_host_gradients_where_the_rule_says(monkeypatch, stage, gas, opt, dtype):
    """Under ``compiled`` the host gradient stays 4 bytes where the host accumulates or
    training is fp32, whether the optimizer is on cpu or nvme; stage 1 with accumulation is 2
    bytes (its micro steps are summed on the GPU), on nvme too."""
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "compiled")
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                       "zero_optimization": {"stage": stage}})
    psi, n = 800_000_000, 4
    r = estimate_memory(psi, gpus_per_node=n, stage=stage, offload_optimizer=opt, dtype=dtype,
                        config=cfg)
    names = {i.name: i.bytes_per_gpu for i in r.items}
    host = sum(b for k, b in names.items() if k in ("gradients",
                                                     "fp32 gradient shard beyond the model states'"))
    assert host == 4 * psi // n  # fp32: the 2-byte partition and 2 beyond it, or 4 bytes
    cfg1 = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                        "zero_optimization": {"stage": 1}})
    for opt1 in ("cpu", "nvme"):
        s1 = estimate_memory(psi, gpus_per_node=n, stage=1, offload_optimizer=opt1,
                             dtype="bf16", config=cfg1)
        rows = {i.name: i.bytes_per_gpu for i in s1.items}
        assert rows["gradient shard for the CPU optimizer"] == 2 * psi // n
        assert "fp32 gradient shard beyond the model states'" not in rows


def test_llama_activation_bytes_by_hand():
    from zeroio.estimate import llama_activation_bytes

    # the 1.364B fit: 8 x 1024 tokens x (24 x (30 x 2048 + 6 x 5632) + 10 x 32000)
    got = llama_activation_bytes(hidden=2048, intermediate=5632, layers=24, vocab=32000,
                                 seq=1024, micro_batch=8)
    assert got == 8192 * (24 * (30 * 2048 + 6 * 5632) + 320_000)
    assert 20e9 < got < 22e9  # the measured ~18.7 GB of layers + ~2.6 GB of logits
