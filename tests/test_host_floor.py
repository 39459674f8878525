"""Host memory at its floor with ``offload_optimizer.device: cpu`` ([Note: the host floor] in
zeroio/placement.py): the optimizer state (12 bytes per parameter for fp32 Adam) and bounded
windows, a second full copy of parameters or gradient only where it fits and is faster.

- By hand, on machine descriptions (bf16, one GPU, a 128 GiB host with 117.59 GB available,
  as the H100 and H200 machines report it): host bytes per parameter of every CPU-offload
  placement, stages 1, 2 and 3 at accumulation 1 and 8, and the preflight's count of them.
- The 8B Llama-3 shape at micro batch 8 x accumulation 8 with configs/zero3-cpu.json as
  shipped, on an 80 GB H100 and a 141 GB H200: admitted (it was refused at 128.48 GB).
- On the CPU (gloo): what the engine allocates in host memory (``hostmem.live_bytes``: every
  host tensor zeroio makes, not RSS) is the placement's host tier (the preflight's count of
  it on a GPU machine, equal by hand) within 5%, at stages 1-3,
  accumulation 1 and 8, with the gradient kept on the (injected) device and without; the
  placement dropping the 16-bit shards when the host is short; training equal to plain torch
  AdamW in every layout.
- ``-m gpu`` (one GPU): the same on the real device, where the window's copies run on their
  CUDA stream and the step assist reads the gradient on the GPU: the gradient kept on the
  GPU against ``gpu_budget_bytes: 0`` (the host path), bit for bit, with the gradient
  crossing PCIe once per step, and host allocations within 5% of the placement.

On the GPU machine:  python -m pytest -q -m gpu tests/test_host_floor.py
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from zeroio.config import load_config
from zeroio.config.accum_place import ACCUM_ROW, WINDOW_ROW, WINDOW_SLOTS
from zeroio.placement import HOST_MARGIN, MachineMemory, decide_placement
from zeroio.testing import run_ranks
from zeroio.testing.markers import needs_compiler

GB, GiB = 10**9, 1 << 30
CHUNK = 1 << 26  # the host step's chunk (tiering.step_chunk_numel's default)
HOST = 117_590_000_000  # the 128 GiB host's available memory, as measured
H100 = 85_520_809_984  # torch.cuda.get_device_properties(...).total_memory, 80 GB H100
H200 = 150_754_820_096  # 141 GB H200
LLAMA3_8B = 8_030_261_248
LAYER_8B = 218_112_000  # one decoder layer of the 8B shape (stage 3's largest group)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "zero3-cpu.json"
CLIP = 0.004  # the gradient norm of _Blocks on _batches is about 0.009: clipping bites


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)  # "auto": the one-pass kernel plan
    monkeypatch.delenv("ZEROIO_STEP_ASSIST", raising=False)
    monkeypatch.delenv("ZEROIO_HOST_MEMORY", raising=False)


def _machine(gpu: int) -> MachineMemory:
    """One GPU of ``gpu`` bytes with 1 GiB taken by the CUDA context, the 128 GiB host."""
    return MachineMemory(gpu_bytes=gpu, gpu_free_bytes=gpu - GiB, host_bytes=HOST,
                         nvme_free_bytes=0)


def _cfg(stage: int, gas: int, micro: int = 1):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return load_config({"train_micro_batch_size_per_gpu": micro,
                        "gradient_accumulation_steps": gas, "bf16": {"enabled": True},
                        "zero_optimization": zero})


def _preflight_bytes(cfg, placement, monkeypatch) -> int:
    """The host-memory preflight's count for this placement on a CUDA device (one rank)."""
    from zeroio.preflight import host_items

    psi = placement.estimate.num_params
    monkeypatch.setattr("zeroio.preflight.true_shape", lambda p: (psi,))
    spec = types.SimpleNamespace(param_groups=[[torch.nn.Parameter(torch.empty(0))]])
    items = host_items(cfg, torch.nn.Module(), spec, torch.device("cuda", 0), world_size=1,
                       local_ranks=1, estimate=placement.estimate)
    return sum(i.bytes_per_gpu for i in items)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 8])
def test_host_bytes_per_parameter_by_hand(stage, gas, monkeypatch):
    """3e9 parameters on the 80 GB H100 machine. The host holds the 12 bytes of fp32 masters
    and moments and windows: the host step's gradient window (2 slots of one 64M-element
    chunk of bf16, the dtype the one-pass CPU Adam reads) and, at stages 1/2, the host step's
    pinned bf16 slots the parameters go up through (4 of a chunk beside the step assist). The gradient stays on the GPU: the fp32
    accumulation buffer at stages 2/3 with 8 micro steps (12 GB, within half the free
    memory less 2 GiB: 82.4 GB free less the replicated bf16 parameters at stage 2), a bf16
    gradient shard otherwise (stage 1 sums its micro steps in the replicated gradient). At
    stage 3 the 16-bit shards (6 GB) fit the host beside the rest, so they stay: a gather
    then copies 2 bytes per element instead of 4 (14 bytes per parameter in all)."""
    psi = 3 * GB
    cfg = _cfg(stage, gas)
    p = decide_placement(num_params=psi, config=cfg, world_size=1, machine=_machine(H100),
                         largest_group=LAYER_8B)
    window = WINDOW_SLOTS * CHUNK * 2
    staging = 4 * CHUNK * 2 if stage < 3 else 0
    shards = 2 * psi if stage == 3 else 0
    assert p.tier_bytes("cpu") == 12 * psi + window + staging + shards
    assert p.gradient_on_device and not p.params_from_master
    rows = {i.name: (i.tier, i.bytes_per_gpu) for i in p.estimate.items}
    assert rows[WINDOW_ROW] == ("cpu", window)
    if gas > 1 and stage > 1:  # the accumulation buffer is the gradient's home
        assert rows[ACCUM_ROW] == ("gpu", 4 * psi)
        assert p.buffer("grad").tiers == {"gpu": 0, "cpu": 0, "nvme": 0}
    else:  # a bf16 gradient shard on the GPU
        assert ACCUM_ROW not in rows
        assert p.buffer("grad").tiers == {"gpu": 2 * psi, "cpu": 0, "nvme": 0}
    assert p.buffer("grad").window_bytes == window
    assert "pinned window" in p.decisions["gradient"]
    assert _preflight_bytes(cfg, p, monkeypatch) == p.tier_bytes("cpu")
    # the same run with nothing on the GPU's spare room (gpu_budget_bytes 0, DeepSpeed's
    # placement): the host gradient shard is back, 2 bytes (one micro step or stage 1), or 4
    # summed over micro steps with the pinned fp32 staging slots
    zero = dict(cfg.to_dict()["zero_optimization"], tiering={"gpu_budget_bytes": 0})
    host = decide_placement(num_params=psi, world_size=1, machine=_machine(H100),
                            largest_group=LAYER_8B, config=load_config(
                                {**cfg.to_dict(), "zero_optimization": zero}))
    grad = 4 if gas > 1 and stage > 1 else 2
    extra = host.buffer("staging").tiers["cpu"] - staging
    assert host.tier_bytes("cpu") == 12 * psi + grad * psi + staging + shards + extra
    assert (extra > 0) == (gas > 1 and stage > 1) and not host.gradient_on_device


@pytest.mark.parametrize("gpu", [H100, H200], ids=["h100-80GB", "h200-141GB"])
def test_8b_llama3_at_micro_batch_8_accumulation_8_is_admitted(gpu, monkeypatch):
    """configs/zero3-cpu.json as shipped (stage 3, optimizer and parameters on the CPU,
    bf16), micro batch 8 x accumulation 8, one GPU, the 128 GiB host (117.59 GB available).
    By hand: 12 x 8.03e9 = 96.36 GB of masters and moments and the 268 MB gradient window;
    the fp32 accumulation buffer (32.1 GB) is the gradient's home on the GPU (it fits half
    of the free memory less 2 GiB on either card); the 16-bit shards (16.06 GB) would take
    the host to 112.7 GB, above 90% of 117.59 = 105.8, so each gather casts the master
    instead. The layout before (shards and a 2-byte host gradient: 128.48 GB) is refused."""
    from zeroio.preflight import HostMemory, host_items, shortfall_message

    raw = json.loads(CONFIG.read_text())
    raw.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=8)
    cfg = load_config(raw)
    p = decide_placement(num_params=LLAMA3_8B, config=cfg, world_size=1,
                         machine=_machine(gpu), largest_group=LAYER_8B)
    window = WINDOW_SLOTS * CHUNK * 2
    assert p.params_from_master and p.gradient_on_device and p.accumulation_on_device
    assert p.tier_bytes("cpu") == 12 * LLAMA3_8B + window
    assert 12 * LLAMA3_8B + window + 2 * LLAMA3_8B > (1 - HOST_MARGIN) * HOST
    assert p.buffer("accumulation").tiers["gpu"] == 4 * LLAMA3_8B
    assert "no 16-bit parameter shards" in p.decisions["param16"]
    assert not p.resident_chunks["enabled"]  # the step assist writes the shards: off
    need = _preflight_bytes(cfg, p, monkeypatch)
    assert need == p.tier_bytes("cpu") and need <= HOST
    monkeypatch.setattr("zeroio.preflight.true_shape", lambda q: (LLAMA3_8B,))
    spec = types.SimpleNamespace(param_groups=[[torch.nn.Parameter(torch.empty(0))]])
    items = host_items(cfg, torch.nn.Module(), spec, torch.device("cuda", 0), world_size=1,
                       local_ranks=1, estimate=p.estimate)
    assert shortfall_message(items, 1, HostMemory(available=HOST, source="128 GiB host"),
                             cfg) is None
    # the layout the measured run was refused with: shards kept, the sum copied to a 2-byte
    # host gradient shard (another optimizer rule: the host shard is stepped whole)
    old = decide_placement(num_params=LLAMA3_8B, config=cfg, world_size=1,
                           machine=_machine(gpu), largest_group=LAYER_8B,
                           params_from_master=False, grad_streams=False)
    assert old.tier_bytes("cpu") == 16 * LLAMA3_8B  # 96.36 + 16.06 + 16.06 = 128.48 GB
    assert old.tier_bytes("cpu") > HOST


# ---- the engine on the CPU: allocations against the placement, training against AdamW -------

class _Blocks(torch.nn.Module):
    """Eight 256-wide blocks (526k parameters): one stage-3 group each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _config(stage: int, gas: int, tiering: dict | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 1 << 16,
            "offload_optimizer": {"device": "cpu"},
            "tiering": {"overlap_step": False, "step_chunk_numel": 1 << 14, **(tiering or {})}}
    if stage == 3:  # a group per block; two blocks gathered at most
        zero["offload_param"] = {"device": "cpu"}
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=1 << 17)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "gradient_clipping": CLIP, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _batches(steps: int, gas: int):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(4, 256, generator=g) for _ in range(gas)] for _ in range(steps)]


def _reference(steps: int, gas: int) -> tuple[list[float], torch.Tensor]:
    """Plain torch AdamW, clipping that bites: the losses and the final parameters."""
    model = _Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for micro in _batches(steps, gas):
        for x in micro:
            loss = model(x).pow(2).mean()
            (loss / gas).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _engine_body(args, tiering=None):
    """Initialize with ``room`` standing in for the device's free memory (None: the device's
    own: a CPU device has none) and ``host`` for the host's; the host bytes zeroio allocated in
    ``initialize``, the placement's host tier and its decisions, then 3 steps' losses and
    final parameters (and the bytes that went device -> host in them)."""
    stage, gas, room, host = args
    import os

    import zeroio
    from zeroio.io import hostmem
    from zeroio.tiering import device_accum

    if room is not None:
        device_accum.DEVICE_ROOM = lambda device: room
    if host is not None:
        os.environ["ZEROIO_HOST_MEMORY"] = str(host)
    model = _Blocks()
    psi = sum(p.numel() for p in model.parameters())
    before = hostmem.live_bytes()
    engine, *_ = zeroio.initialize(model=model, config=_config(stage, gas, tiering))
    allocated = hostmem.live_bytes() - before
    part, placed = engine.partitioner, engine.placement
    d2h = engine.stats()["bytes_moved"].get("gpu->cpu", 0)
    losses = []
    for micro in _batches(3, gas):
        for x in micro:
            loss = engine(x.to(engine.device)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with zeroio.zero.GatheredParameters(list(model.parameters())):
        params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    engine.synchronize()
    from zeroio.config import load_config as load
    from zeroio.preflight import host_items

    one = types.SimpleNamespace(param_groups=[[torch.nn.Parameter(torch.empty(1))]])
    preflight = sum(i.bytes_per_gpu for i in host_items(  # its count where the device is a GPU
        load(_config(stage, gas, tiering)), model, one, torch.device("cuda", 0), world_size=1,
        local_ranks=1, estimate=placed.estimate))
    out = {"allocated": allocated, "placed_cpu": placed.tier_bytes("cpu"), "preflight": preflight,
           "d2h": engine.stats()["bytes_moved"].get("gpu->cpu", 0) - d2h,
           "streamed": part.grads_streamed, "planned": placed.gradient_on_device,
           "from_master": placed.params_from_master, "decisions": placed.decisions,
           "store": type(part.store).__name__ if stage == 3 else None,
           "psi": psi,
           "host_need": placed.host_bytes_per_node(),
           "losses": losses, "params": params.cpu().tolist()}
    engine.close()
    return out


def _run(stage, gas, room=None, host=None):
    (out,) = run_ranks(_engine_body, 1, (stage, gas, room, host), timeout=300)
    return out


def _check_training(out, gas):
    ref_losses, ref_params = _reference(3, gas)
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    got = torch.tensor(out["params"])
    assert (got - ref_params).abs().max().item() < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 8])
def test_the_engine_allocates_the_placement_s_host_bytes(stage, gas):
    """fp32 training on the CPU with a device room injected (the gradient kept on the
    "device"), against plain AdamW. Host memory zeroio allocates is the placement's host tier
    within 5%, and by hand: 12 bytes per parameter of masters and moments, the parameter
    shards at stage 3 (fp32 here, 4 bytes: they fit the host), and the window (2 slots of
    the 16k-element chunk); no gradient shard in host memory."""
    out = _run(stage, gas, room=1 << 40)
    assert out["streamed"] and out["planned"] and not out["from_master"]
    psi = out["psi"]
    hand = 12 * psi + (4 * psi if stage == 3 else 0) + WINDOW_SLOTS * (1 << 14) * 4
    assert out["placed_cpu"] == hand == out["preflight"]
    assert abs(out["allocated"] - out["placed_cpu"]) <= 0.05 * out["placed_cpu"], out
    _check_training(out, gas)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_without_device_room_the_host_holds_the_gradient(stage):
    """No device room (a CPU device): the gradient lives in host memory, one fp32 shard (4
    bytes per parameter) beside the state; the engine allocates that within 5% too."""
    out = _run(stage, 1)
    assert not out["streamed"] and not out["planned"]
    psi = out["psi"]
    assert out["placed_cpu"] == 16 * psi + (4 * psi if stage == 3 else 0) == out["preflight"]
    assert abs(out["allocated"] - out["placed_cpu"]) <= 0.05 * out["placed_cpu"], out
    assert "in host memory" in out["decisions"]["gradient"]
    _check_training(out, 1)


def test_a_short_host_drops_the_16bit_shards():
    """Stage 3 with optimizer and parameters on the CPU, a host (ZEROIO_HOST_MEMORY) that holds
    the floor with 10% to spare but not the parameter shards beside it: the placement drops
    them (params_from_master), the partitioner reads the masters, nothing of the shards is
    allocated in host memory, and training is plain AdamW's. With room for them they stay."""
    roomy = _run(3, 1, room=1 << 40)
    psi = roomy["psi"]
    floor = 12 * psi + WINDOW_SLOTS * (1 << 14) * 4
    # a CPU device's host also holds the device's state: the placement and the preflight
    # count it ("host_need"); the shards no longer fit with the margin left free
    short = _run(3, 1, room=1 << 40, host=int(roomy["host_need"] / (1 - HOST_MARGIN)) - 1)
    assert not roomy["from_master"] and roomy["store"] == "HostShards"
    assert short["from_master"] and short["store"] == "MasterShards"
    assert "no 16-bit parameter shards" in short["decisions"]["param16"]
    assert "kept in host memory" in roomy["decisions"]["param16"]
    assert short["placed_cpu"] == floor == short["preflight"]
    assert abs(short["allocated"] - floor) <= 0.05 * floor, short
    assert short["losses"] == roomy["losses"] and short["params"] == roomy["params"]
    _check_training(short, 1)


def _gpu_body(stage, gas):
    out = {}
    for mode, budget in (("device", None), ("host", 0)):
        # the step assist off: the two runs differ only in where the gradient lives
        out[mode] = _engine_body((stage, gas, None, None), tiering={
            "gpu_budget_bytes": budget, "step_assist": False, "overlap_step": True})
    out["assist"] = _engine_body((stage, gas, None, None), tiering={"overlap_step": True})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 4])
def test_the_floor_on_the_gpu(stage, gas):
    """One GPU, fp32, the overlapped host step: the gradient kept on the GPU and read through
    the window equals the host path (``gpu_budget_bytes: 0``): bit for bit with one micro
    step; with 4 the clip norm of the summed gradient is taken on the GPU instead of the host
    (another summation order: the clipping coefficient may differ in its last bits); the
    gradient
    crosses PCIe once per step instead of once per micro step at stages 2/3 (3 steps, 4 bytes
    an element); host allocations are the placement's host tier within 5%; with the step
    assist (which reads the gradient on the GPU) training stays plain AdamW's."""
    from zeroio.testing.cuda import need_cuda

    need_cuda(1)
    (out,) = run_ranks(_gpu_body, 1, stage, gas, backend="nccl", timeout=600)
    dev, host = out["device"], out["host"]
    assert dev["streamed"] and dev["planned"] and not host["streamed"] and not host["planned"]
    if gas == 1:
        assert dev["losses"] == host["losses"] and dev["params"] == host["params"]
    else:
        assert dev["losses"] == pytest.approx(host["losses"], rel=1e-6)
        diff = torch.tensor(dev["params"]) - torch.tensor(host["params"])
        assert diff.abs().max().item() < 1e-6
    grad = 4 * dev["psi"]
    lands = gas if stage > 1 else 1
    assert host["d2h"] - dev["d2h"] == 3 * (lands - 1) * grad
    for r in (dev, host, out["assist"]):
        assert abs(r["allocated"] - r["placed_cpu"]) <= 0.05 * r["placed_cpu"], r
    ref_losses, ref_params = _reference(3, gas)
    for r in (dev, out["assist"]):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
        assert (torch.tensor(r["params"]) - ref_params).abs().max().item() < 1e-4


def _fp16_body(stage):
    """fp16, 2 micro steps, the gradient kept on the (injected) device as an fp32 sum that the
    host step reads in fp16: a sum beyond fp16's range is an overflow, the step is skipped."""
    import zeroio
    from zeroio.tiering import device_accum

    device_accum.DEVICE_ROOM = lambda device: 1 << 40
    cfg = _config(stage, 2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = zeroio.initialize(model=_Blocks(), config=cfg)
    part = engine.partitioner
    out = {"streamed": part.grads_streamed, "read": str(part.grad_read_dtype),
           "home": str(part.groups[0].grad.dtype if stage < 3 else
                       part.optimizer_split.host[0].grad.dtype if part.optimizer_split
                       else part.groups[0].grad.dtype)}
    masters = [engine.optimizer.local_tensor(g.group_index, "fp32").clone() for g in part.groups]
    for m, x in enumerate(_batches(1, 2)[0]):
        engine.backward(engine(x.half()).float().pow(2).mean())
        if m == 1:  # the boundary: the sum, finite in fp32, past fp16's range in one element
            part.groups[0].grad.view(-1)[3] = 7e4
        engine.step()
    out["skipped"] = engine.skipped_steps
    out["same"] = all(torch.equal(a, engine.optimizer.local_tensor(g.group_index, "fp32"))
                      for a, g in zip(masters, part.groups, strict=True))
    engine.close()
    return out


@needs_compiler
@pytest.mark.parametrize("stage", [2, 3])
def test_a_sum_past_fp16_range_where_it_is_read_is_an_overflow(stage):
    (out,) = run_ranks(_fp16_body, 1, stage, env={"ZEROIO_CPU_ADAM": "compiled"},
                       timeout=600)
    assert out["streamed"] and out["read"] == "torch.float16" and out["home"] == "torch.float32"
    assert out["skipped"] == 1 and out["same"]


def test_cast_overflows_by_hand():
    from zeroio.partition.grad_norm import cast_overflows
    from zeroio.tiering.copies import Copies

    ok, big = torch.full((10,), 6.5e4), torch.tensor([1.0, 7e4, 2.0])
    assert not cast_overflows([ok], torch.float16, Copies(None))  # rounds to 65504
    assert cast_overflows([ok, big], torch.float16, Copies(None))
    assert not cast_overflows([big], torch.bfloat16, Copies(None))  # bf16 has fp32's range
    assert not cast_overflows([big.half().float()[:1]], torch.float16, Copies(None))


def _short_host_gpu_body(_):
    off = {"step_assist": False, "overlap_step": True}
    roomy = _engine_body((3, 4, None, None), tiering=off)
    short = _engine_body((3, 4, None, int(roomy["host_need"] / (1 - HOST_MARGIN)) - 1),
                         tiering=off)
    return roomy, short


@pytest.mark.gpu
def test_a_short_host_drops_the_16bit_shards_on_the_gpu():
    """One GPU, stage 3, 4 micro steps, the overlapped step: a host too small for the shards
    beside the rest makes the placement cast each gather from the host masters (an H2D copy
    of fp32 on the h2d stream, then the cast), beside the gradient kept on the GPU and read
    through the window; bit for bit the run that keeps the shards, and nothing of them is
    allocated in host memory."""
    from zeroio.testing.cuda import need_cuda

    need_cuda(1)
    (out,) = run_ranks(_short_host_gpu_body, 1, None, backend="nccl", timeout=600)
    roomy, short = out
    assert not roomy["from_master"] and short["from_master"] and short["store"] == "MasterShards"
    assert roomy["streamed"] and short["streamed"]
    assert short["losses"] == roomy["losses"] and short["params"] == roomy["params"]
    assert roomy["placed_cpu"] - short["placed_cpu"] == 4 * roomy["psi"]  # fp32 shards
    assert abs(short["allocated"] - short["placed_cpu"]) <= 0.05 * short["placed_cpu"]


def _nvme_shards_body(args):
    gas, room, path = args
    import zeroio
    from zeroio.tiering import device_accum

    if room is not None:
        device_accum.DEVICE_ROOM = lambda device: room
    cfg = _config(3, gas)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path,
                                                 "max_in_cpu": 0}
    engine, *_ = zeroio.initialize(model=_Blocks(), config=cfg)
    streamed = engine.partitioner.grads_streamed
    losses = []
    for micro in _batches(3, gas):
        for x in micro:
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    engine.close()
    return streamed, losses


@pytest.mark.parametrize("gas", [1, 2])
def test_nvme_parameter_shards_step_through_the_window_too(tmp_path, gas):
    """Stage 3 with the parameter shards on NVMe steps whole groups on the training thread
    (then publishes): with the gradient kept on the device it reads it through the window
    chunk by chunk, bit for bit the host path."""
    (ref,) = run_ranks(_nvme_shards_body, 1, (gas, None, str(tmp_path / "a")), timeout=300)
    (got,) = run_ranks(_nvme_shards_body, 1, (gas, 1 << 40, str(tmp_path / "b")), timeout=300)
    assert not ref[0] and got[0]
    assert got[1] == ref[1]
