"""The placement planner (zeroio/plan.py) on made-up machines, against hand computations of
the bytes each placement puts on each tier (DeepSpeed's default bucket sizes: reduce_bucket_size
5e8, stage3_max_live_parameters 1e9; bf16, b = 2), and `zeroio estimate --plan`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroio.cli.main import main
from zeroio.config import load_config
from zeroio.errors import CapacityError, ConfigError
from zeroio.plan import MARGIN, Machine, plan_placement

GB = 10**9
PSI = 10**10  # 10B parameters on one GPU: the rank's shard is all of them
GROUP = 500_000_000  # reduce_bucket_size, standing in for the largest flat group
# stage 3 GPU buffers: fp32 buckets 2 x 4 x G, autograd's 16-bit gradients 2 x G,
# live gathered parameters 2 x (1e9 + G)
STAGE3_BUFFERS = 2 * 4 * GROUP + 2 * GROUP + 2 * (10**9 + GROUP)


def machine(**kw) -> Machine:
    base = dict(gpus=1, gpu_bytes=80 * GB, host_bytes=256 * GB, disk_bytes=1000 * GB,
                pcie_bps=25 * GB, disk_read_bps=6 * GB, disk_write_bps=3 * GB,
                cpu_adam_elems_per_s=2 * GB)
    return Machine(**{**base, **kw})


@pytest.fixture(autouse=True)
def _auto_cpu_adam(monkeypatch):
    # the host gradient's dtype follows ZEROIO_CPU_ADAM; the hand figures assume its default
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)


def test_small_model_on_a_big_gpu_stays_on_the_gpu():
    psi = 10**8
    plan = plan_placement(psi, machine(), micro_batch=1, seq=1024)
    assert plan.placement == "stage 2, all on the GPU"
    assert plan.config["zero_optimization"] == {"stage": 2, "sub_group_size": 10**9}
    # params 2 + gradients 2 + Adam 12 + fp32 gradient 4 bytes each, one 16-bit reduce bucket
    # and the 16-bit all-gather bucket (both capped at Psi)
    assert plan.tiers[0].need_bytes == (2 + 2 + 12 + 4) * psi + 2 * psi + 2 * psi
    assert plan.tiers[1].need_bytes == 0 and plan.tiers[2].need_bytes == 0
    assert set(plan.traffic.values()) == {0} and plan.step_s == 0 and plan.reasons == ()


def test_optimizer_that_fits_only_the_host_goes_to_the_cpu():
    # GPU: the 16-bit shard 2 Psi + buffers = 28 GB <= 0.9 x 32 GB; 1% more on the GPU would
    # add 16 bytes (Adam 12, gradient 2 + its fp32 rest 2) x 1e8 = 1.6 GB: over. A CPU Adam of
    # 20 G elements/s makes the link the bound (0.8 s): offloading the parameters too would
    # copy 2 x 2 Psi up per step (1.6 s), slower, so this placement is the fastest that fits
    gpu = 32 * GB
    fixed = 2 * PSI + STAGE3_BUFFERS
    assert fixed <= (1 - MARGIN) * gpu < fixed + 16 * PSI // 100
    plan = plan_placement(PSI, machine(gpu_bytes=gpu, cpu_adam_elems_per_s=20 * GB),
                          micro_batch=1, seq=1024)
    assert plan.placement == "stage 3, optimizer on the CPU"
    zero = plan.config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "ratio": 1.0}
    assert "offload_param" not in zero and "tiering" not in zero
    assert plan.tiers[0].need_bytes == fixed
    assert plan.tiers[1].need_bytes == (12 + 2) * PSI  # Adam + 16-bit host gradients
    assert len(plan.reasons) == 3 and "GPU memory" in plan.reasons[1]
    assert plan.step_s == pytest.approx(2 * PSI / (25 * GB)) and plan.bound == "pcie_s"
    params = next(c for c in plan.compared
                  if c.startswith("stage 3, optimizer and parameters on the CPU"))
    assert "predicted 1.600 s per step (bound by pcie_s); slower than the chosen 0.800" in params
    load_config(plan.config)  # the block it prints loads


def test_gpu_share_is_the_largest_whole_percent_that_fits():
    gpu = 41 * GB
    fixed = 2 * PSI + STAGE3_BUFFERS
    k = max(k for k in range(100) if fixed + 16 * (PSI * k // 100) <= (1 - MARGIN) * gpu)
    assert k == 5  # 36.9 GB usable, 8.9 GB spare: 5.56% of 1e10 elements at 16 bytes
    m = machine(gpu_bytes=gpu, cpu_adam_elems_per_s=20 * GB)  # the link bounds: as above
    plan = plan_placement(PSI, m, micro_batch=1, seq=1024)
    assert plan.placement == "stage 3, optimizer on the CPU"
    assert plan.config["zero_optimization"]["offload_optimizer"]["ratio"] == pytest.approx(
        1 - k / 100)
    dev = PSI * k // 100
    host = PSI - dev
    assert plan.estimate.placement()["gpu_elements_per_gpu"] == pytest.approx(dev, abs=1)
    assert plan.tiers[0].need_bytes == pytest.approx(fixed + 16 * dev, abs=16)
    assert plan.tiers[1].need_bytes == pytest.approx(14 * host, abs=14)
    # 16-bit gradients down, updated 16-bit parameters up, CPU Adam over the host elements
    assert plan.traffic["gpu->cpu"] == pytest.approx(2 * host, abs=2)
    assert plan.traffic["cpu->gpu"] == pytest.approx(2 * host, abs=2)
    assert plan.times["cpu_adam_s"] == pytest.approx(host / m.cpu_adam_elems_per_s, rel=1e-9)
    assert plan.times["pcie_s"] == pytest.approx(2 * host / m.pcie_bps, rel=1e-9)
    assert plan.bound == "pcie_s"


def test_the_plan_takes_the_shortest_predicted_step():
    """Not the first placement that fits: on the 41 GB GPU with a CPU Adam of 2 G elements/s
    the optimizer on the CPU (5% of it kept on the GPU) is bound by CPU Adam over 0.95e10
    elements, 4.75 s; offloading the 16-bit parameters as well frees 2 Psi of GPU memory for a
    larger share of the optimizer state, so CPU Adam steps fewer elements and the step is
    shorter, though the shards cross PCIe forward and backward (4e10 bytes: 1.6 s). The plan
    says so: the placement it passed over is listed with its prediction."""
    m = machine(gpu_bytes=41 * GB)
    plan = plan_placement(PSI, m, micro_batch=1, seq=1024)
    assert plan.placement == "stage 3, optimizer and parameters on the CPU"
    host = plan.estimate.placement()["offloaded_elements_per_gpu"]
    assert host < 0.95 * PSI and plan.bound == "cpu_adam_s"
    assert plan.step_s == pytest.approx(host / m.cpu_adam_elems_per_s)
    assert plan.times["pcie_s"] == pytest.approx(2 * 2 * PSI / m.pcie_bps)
    assert plan.step_s < 4.75
    cpu = next(c for c in plan.compared if c.startswith("stage 3, optimizer on the CPU:"))
    assert f"predicted 4.750 s per step (bound by cpu_adam_s); slower than the chosen " \
           f"{plan.step_s:.3f} s" in cpu
    # the placements tried before it that do not fit are the reasons, as before
    assert [r.split(":")[0] for r in plan.reasons][:2] == ["stage 2, all on the GPU",
                                                            "stage 3, all on the GPU"]
    assert plan.to_dict()["compared"] == list(plan.compared)


def test_model_bigger_than_host_memory_streams_its_moments_from_nvme():
    """Bytes per step and every time term by hand, on the NVMe placement (a GPU that takes
    no 1% share of the optimizer state: 2 Psi + buffers = 28 GB <= 28.8 < 29.6 GB)."""
    m = machine(gpu_bytes=32 * GB, host_bytes=128 * GB, disk_bytes=200 * GB)
    plan = plan_placement(PSI, m, micro_batch=1, seq=1024, params_from_master=False)
    assert plan.placement == "stage 3, optimizer on NVMe"
    usable_host = 115_200_000_000  # 0.9 x 128 GB
    # rejected on host memory: Adam 12 + 16-bit gradient 2 (+ 16-bit parameters 2)
    assert f"{14 * PSI - usable_host:,} bytes" in plan.reasons[2]
    assert f"{16 * PSI - usable_host:,} bytes" in plan.reasons[3]
    assert all("host memory" in r for r in plan.reasons[2:])
    zero = plan.config["zero_optimization"]
    assert zero["tiering"] == {"cpu_budget_bytes": usable_host}
    assert zero["offload_optimizer"]["device"] == "nvme" and zero["sub_group_size"] == 10**8
    # host: 16-bit gradient 2 (the swapper's one-pass CPU Adam reads it: optim/swap.py) + fp32
    # master 4 bytes, the swap window (the piece being updated and 3 read ahead, of 2^24
    # elements' two fp32 moments), then whole pieces of moments cached (the disk homes them all)
    pair = 2 * 4 * (1 << 24)
    held = 6 * PSI + 4 * pair
    resident = (usable_host - held) // pair * pair
    assert plan.tiers[1].need_bytes == held + resident <= usable_host
    assert plan.tiers[2].need_bytes == 8 * PSI  # the moments
    assert plan.resident_moment_bytes == resident == 54_626_615_296
    streamed = 8 * PSI - resident
    assert plan.traffic == {"gpu->cpu": 2 * PSI, "cpu->gpu": 2 * PSI, "nvme->cpu": streamed,
                            "cpu->nvme": streamed}
    assert plan.times == pytest.approx({"cpu_adam_s": PSI / (2 * GB),
                                        "pcie_s": 2 * PSI / (25 * GB),
                                        "disk_s": streamed / (6 * GB) + streamed / (3 * GB)})
    # the NVMe optimizer steps after forward and backward: their parameter traffic (0.8 s)
    # plus the larger of CPU Adam (5 s) and the disk (streamed / 2 GB/s: 12.7 s)
    assert plan.step_s == pytest.approx(0.8 + streamed / (2 * GB))
    assert plan.bound == "pcie_s + disk_s"
    load_config(plan.config)


def test_cpu_budget_is_per_rank_on_a_node_of_several_gpus():
    m = machine(gpus=4, gpu_bytes=32 * GB, host_bytes=512 * GB, disk_bytes=800 * GB)
    plan = plan_placement(4 * PSI, m, micro_batch=1, seq=1024, params_from_master=False)  # the previous test, x 4
    assert plan.placement == "stage 3, optimizer on NVMe"
    assert plan.config["zero_optimization"]["tiering"]["cpu_budget_bytes"] == 115_200_000_000
    assert plan.resident_moment_bytes == 4 * 54_626_615_296
    assert plan.tiers[2].need_bytes == 8 * 4 * PSI  # the node's four shards of moments


def test_model_bigger_than_the_disk_names_the_disk_and_the_shortfall():
    # a GPU that takes the most offloaded placement's buffers (14 GB: stage 3 buffers and the
    # fp32 masters copied in before their cast, 4 x 1.5e9: params_from_master "auto" is on with
    # the NVMe optimizer) but no 1% share of the optimizer state (1.6 GB more)
    m = machine(gpu_bytes=16 * GB, host_bytes=128 * GB, disk_bytes=20 * GB)
    with pytest.raises(CapacityError) as err:
        plan_placement(PSI, m, micro_batch=1, seq=1024)
    msg = str(err.value)
    # the most offloaded placement: host holds the fp32 master 4 + 16-bit gradient 2 bytes per
    # element and 5 parameter swap buffers of 1e8 16-bit elements; the rest of the 115.2 GB
    # budget is the optimizer's share: a window of 4 pieces of 2^24 elements' two fp32 moments
    # (pipeline_read: 3 ahead), then whole pieces resident in host memory (the disk cannot hold
    # every moment); the disk holds the streamed moments (the 16-bit parameters have no NVMe
    # home: the gathers cast the host masters)
    share = 115_200_000_000 - 6 * PSI - 5 * 10**8 * 2
    pair = 2 * 4 * (1 << 24)
    resident = (share - 4 * pair) // pair * pair
    short = 8 * PSI - resident - (20 * GB - (1 << 30))
    assert f"{short:,} bytes" in msg and "disk" in msg
    assert "optimizer and parameters on NVMe" in msg
    assert "GPU memory" not in msg and "host memory" not in msg


def test_a_disk_too_small_for_every_moment_keeps_the_resident_head_only_in_host_memory():
    """The previous machine with a 50 GB disk: the moments (80 GB) do not fit it, but what the
    host budget keeps resident needs no disk home (optim/swap.py), so the tail fits."""
    m = machine(gpu_bytes=32 * GB, host_bytes=128 * GB, disk_bytes=50 * GB)
    plan = plan_placement(PSI, m, micro_batch=1, seq=1024, params_from_master=False)
    assert plan.placement == "stage 3, optimizer on NVMe" and plan.ratio == 1.0
    share = 115_200_000_000 - 6 * PSI
    pair = 2 * 4 * (1 << 24)
    resident = (share - 4 * pair) // pair * pair
    assert plan.resident_moment_bytes == resident
    assert plan.tiers[2].need_bytes == 8 * PSI - resident <= 50 * GB - (1 << 30)
    assert plan.tiers[1].need_bytes == 6 * PSI + 4 * pair + resident <= 115_200_000_000
    assert plan.config["zero_optimization"]["tiering"] == {
        "cpu_budget_bytes": 115_200_000_000, "nvme_budget_bytes": 50 * GB - (1 << 30)}
    streamed = 8 * PSI - resident
    assert plan.traffic["nvme->cpu"] == plan.traffic["cpu->nvme"] == streamed
    load_config(plan.config)


def test_activations_count_on_the_gpu():
    shape = dict(layers=24, hidden=2048, vocab=32000, intermediate=5632)
    base = plan_placement(10**8, machine(), micro_batch=1, seq=1024, largest_group=GROUP)
    act = plan_placement(10**8, machine(), micro_batch=4, seq=1024, largest_group=GROUP,
                         **shape)
    # 4096 tokens x (24 x (30 x 2048 + 6 x 5632) + 10 x 32000) bytes
    tokens = 4 * 1024
    want = tokens * (24 * (30 * 2048 + 6 * 5632) + 10 * 32000)
    assert act.tiers[0].need_bytes - base.tiers[0].need_bytes == want


def _write(tmp_path, raw) -> Path:
    p = tmp_path / "machine.json"
    p.write_text(json.dumps(raw))
    return p


def test_a_disk_slower_at_reading_and_writing_at_once_sets_the_disk_time():
    """With ``disk_mixed_bps`` the disk term is max((read + write) / mixed, read / read_bps,
    write / write_bps), by hand on the same NVMe placement as above; the bytes and the
    placement do not change. A mixed rate above both alone still leaves each direction its
    own floor."""
    base = machine(gpu_bytes=32 * GB, host_bytes=128 * GB, disk_bytes=200 * GB)
    ref = plan_placement(PSI, base, micro_batch=1, seq=1024, params_from_master=False)
    streamed = ref.traffic["nvme->cpu"]
    slow = plan_placement(PSI, dataclasses.replace(base, disk_mixed_bps=1.25 * GB),
                          micro_batch=1, seq=1024, params_from_master=False)
    assert slow.placement == ref.placement and slow.traffic == ref.traffic
    assert slow.times["disk_s"] == pytest.approx(2 * streamed / (1.25 * GB))
    assert slow.step_s == pytest.approx(ref.times["pcie_s"] + 2 * streamed / (1.25 * GB))
    assert slow.step_s > ref.step_s
    fast = plan_placement(PSI, dataclasses.replace(base, disk_mixed_bps=100 * GB),
                          micro_batch=1, seq=1024, params_from_master=False)
    assert fast.times["disk_s"] == pytest.approx(streamed / (3 * GB))  # the write alone


def test_cli_disk_mixed_flag_and_machine_file_key(tmp_path, zeroio_estimate):
    flags = ("--plan", "--params", "10B", "--gpu-mem", "32", "--host-mem", "128",
             "--disk-free", "200", "--pcie-gbps", "25", "--disk-read-gbps", "6",
             "--disk-write-gbps", "3", "--cpu-adam-gelems", "2", "--seq", "1024", "--json")
    plain = json.loads(zeroio_estimate(*flags).stdout)
    mixed = json.loads(zeroio_estimate(*flags, "--disk-mixed-gbps", "1.25").stdout)
    assert plain["machine"]["disk_mixed_bps"] is None
    assert mixed["machine"]["disk_mixed_bps"] == 1.25 * GB
    both = mixed["bytes_per_step"]["nvme->cpu"] + mixed["bytes_per_step"]["cpu->nvme"]
    assert mixed["times"]["disk_s"] == pytest.approx(both / (1.25 * GB))
    m = dataclasses.replace(machine(), disk_mixed_bps=2 * GB)
    assert Machine.from_json(_write(tmp_path, m.to_dict())) == m
    proc = zeroio_estimate("--plan", "--params", "1B", "--machine", str(_write(tmp_path, m.to_dict())),
                           "--disk-mixed-gbps", "2")
    assert proc.returncode == 2 and "--disk-mixed-gbps" in proc.stderr
    bad = _write(tmp_path, {**m.to_dict(), "disk_mixed_bps": 0})
    proc = zeroio_estimate("--plan", "--params", "1B", "--machine", str(bad))
    assert proc.returncode == 2 and "machine.disk_mixed_bps" in proc.stderr


def test_bad_machine_json_names_the_key(tmp_path):
    good = machine().to_dict()
    assert Machine.from_json(_write(tmp_path, good)) == machine()
    old_file = {k: v for k, v in good.items() if k != "disk_mixed_bps"}  # the key is optional
    assert Machine.from_json(_write(tmp_path, old_file)) == machine()
    cases = [
        ({**{k: v for k, v in good.items() if k != "gpu_bytes"}, "gpu_byte": 1}, "machine.gpu_byte"),
        ({k: v for k, v in good.items() if k != "pcie_bps"}, "machine.pcie_bps"),
        ({**good, "host_bytes": -5}, "machine.host_bytes"),
        ({**good, "gpus": "8"}, "machine.gpus"),
        ({**good, "gpus": 1.5}, "machine.gpus"),
    ]
    for raw, key in cases:
        with pytest.raises(ConfigError) as err:
            Machine.from_json(_write(tmp_path, raw))
        assert err.value.key == key and key in str(err.value)
    with pytest.raises(ConfigError, match="did you mean \"gpu_bytes\""):
        Machine.from_json(_write(tmp_path, cases[0][0]))
    (tmp_path / "machine.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON file"):
        Machine.from_json(tmp_path / "machine.json")


@pytest.fixture
def zeroio_estimate(capsys):
    """`zeroio estimate ARGS` in this process (the command's own main): (exit, out, err)."""
    def call(*args):
        capsys.readouterr()
        rc = main(["estimate", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)
    return call


def test_cli_json_is_plan_to_dict_from_file_or_flags(tmp_path, zeroio_estimate):
    m = machine(host_bytes=128 * GB, disk_bytes=200 * GB)
    want = json.loads(json.dumps(plan_placement(PSI, m, micro_batch=1, seq=2048).to_dict()))
    proc = zeroio_estimate("--plan", "--params", "10B", "--machine", str(_write(tmp_path, m.to_dict())),
                   "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == want
    flags = zeroio_estimate("--plan", "--params", "10B", "--gpu-mem", "80", "--host-mem", "128",
                    "--disk-free", "200", "--pcie-gbps", "25", "--disk-read-gbps", "6",
                    "--disk-write-gbps", "3", "--cpu-adam-gelems", "2")
    assert flags.returncode == 0, flags.stderr
    assert "plan: stage 3, optimizer on NVMe" in flags.stdout
    assert '"cpu_budget_bytes": 115200000000' in flags.stdout


def test_cli_errors_name_the_flag_or_key(tmp_path, zeroio_estimate):
    bad = _write(tmp_path, {**machine().to_dict(), "disk_read_bps": 0})
    proc = zeroio_estimate("--plan", "--params", "1B", "--machine", str(bad))
    assert proc.returncode == 2 and "machine.disk_read_bps" in proc.stderr
    proc = zeroio_estimate("--plan", "--params", "1B", "--gpu-mem", "80")
    assert proc.returncode == 2 and "--host-mem" in proc.stderr
    proc = zeroio_estimate("--plan", "--params", "1B", "--stage", "2", "--machine", str(bad))
    assert proc.returncode == 2 and "--stage" in proc.stderr
    proc = zeroio_estimate("--params", "1B", "--gpu-mem", "80")
    assert proc.returncode == 2 and "--gpu-mem needs --plan" in proc.stderr
    full = zeroio_estimate("--plan", "--params", "1T", "--machine",
                   str(_write(tmp_path, dataclasses.asdict(machine(disk_bytes=0)))))
    assert full.returncode == 1 and "disk under the NVMe path" in full.stderr
