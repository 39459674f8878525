"""`zeroio train --plan` (zeroio/cli/train/placement.py): the placement the planner chooses for a
machine is the one the engine trains with, read back from the run's summary and its
zeroio-plan.json; a machine nothing fits stops the run before anything is written; the
measuring path (zeroio/cli/train/machine.py) with injected probes and for real on this CPU.

The runs train the tiny Llama shape for 3 steps on one CPU rank (in-process, seconds each).
The machines are made up so that each forces one placement of the rule; the bytes each
placement needs are zeroio.estimate's (tests/test_plan.py checks those against hand counts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroio.cli.main import main
from zeroio.cli.train.placement import PLAN_FILE

GB = 10**9
MB = 10**6
BIG = dict(gpus=1, gpu_bytes=80 * GB, host_bytes=256 * GB, disk_bytes=1000 * GB,
           pcie_bps=25 * GB, disk_read_bps=6 * GB, disk_write_bps=3 * GB,
           cpu_adam_elems_per_s=2 * GB)
MODEL = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 256, "max_position_embeddings": 2048, "tie_word_embeddings": False}
ARGS = ["--steps", "3", "--seq-len", "64", "--micro-batch", "2", "--nproc", "1", "--no-checkpoint"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("ZEROIO_CPU_ADAM", raising=False)  # the planner's host gradient dtype
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def _files(tmp_path: Path, **machine) -> tuple[Path, Path]:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MODEL))
    m = tmp_path / "machine.json"
    m.write_text(json.dumps({**BIG, **machine}))
    return cfg, m


def _run(capsys, out: Path, *extra: str) -> tuple[int, str, str]:
    rc = main(["train", *ARGS, "--output", str(out), *extra])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _train(capsys, out: Path, *extra: str) -> tuple[int, dict | None, str]:
    rc, stdout, err = _run(capsys, out, *extra)
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    summary = json.loads(lines[-1]) if rc == 0 and "--json" in extra else None
    return rc, summary, err


def _engine_matches_plan(summary: dict, out: Path) -> dict:
    """The plan file's applied keys are what the engine's config held (the summary reads them
    from the resolved config and the store's budgets from engine.stats())."""
    record = json.loads((out / PLAN_FILE).read_text())
    zero = record["zero_optimization"]
    assert summary["plan"]["zero_optimization"] == zero
    assert summary["plan"]["placement"] == record["placement"] == record["plan"]["placement"]
    assert summary["stage"] == zero["stage"]
    assert summary["sub_group_size"] == zero["sub_group_size"]
    oo = zero.get("offload_optimizer", {"device": "none", "ratio": 1.0})
    assert summary["offload_optimizer"] == oo["device"]
    assert summary["offload_optimizer_ratio"] == pytest.approx(oo["ratio"])
    assert summary["offload_param"] == zero.get("offload_param", {"device": "none"})["device"]
    assert summary["plan"]["predicted_step_s"] == record["plan"]["step_s"]
    assert summary["plan"]["measured_step_s"] > 0
    assert summary["plan"]["machine_source"].endswith("machine.json")
    return record


def test_big_machine_keeps_everything_on_the_gpu(tmp_path, capsys):
    cfg, m = _files(tmp_path)
    rc, s, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine",
                        str(m), "--json")
    assert rc == 0, err
    record = _engine_matches_plan(s, tmp_path / "run")
    assert record["placement"] == "stage 2, all on the GPU"
    assert record["zero_optimization"] == {"stage": 2, "sub_group_size": 10**9}
    assert s["plan"]["predicted_step_s"] == 0
    assert len(s["losses"]) == 3
    assert err == ""  # --json: nothing but the summary, the plan block included in it


def test_small_gpu_offloads_part_of_the_optimizer_to_the_cpu(tmp_path, capsys):
    # 12 MB: stage 2 (12.7 MB) and stage 3 all on the GPU do not fit 90% of it; stage 3 with
    # the optimizer on the CPU at ratio 1 needs 6.8 MB, so part of the optimizer stays
    cfg, m = _files(tmp_path, gpu_bytes=12 * MB)
    rc, s, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine",
                        str(m), "--json")
    assert rc == 0, err
    record = _engine_matches_plan(s, tmp_path / "run")
    assert record["placement"] == "stage 3, optimizer on the CPU"
    ratio = record["zero_optimization"]["offload_optimizer"]["ratio"]
    assert 0 < ratio < 1 and s["offload_optimizer_ratio"] == pytest.approx(ratio)
    reasons = record["plan"]["reasons"]
    assert reasons[0].startswith("stage 2, all on the GPU: GPU memory (per GPU) overflows by")
    tiers = record["plan"]["tiers"]
    assert tiers["gpu"]["need_bytes"] <= tiers["gpu"]["usable_bytes"] == int(0.9 * 12 * MB)


def test_small_host_puts_the_optimizer_on_nvme(tmp_path, capsys, monkeypatch):
    # The NVMe placements' pinned swap buffers (4 x sub_group_size x 4 bytes, capped at the
    # shard) make the NVMe host term of a 0.4M model larger than the CPU placement's, which
    # a real model (shard >> 1e8) never sees: shrink the planner's NVMe sub_group_size so the
    # tiny model has the proportions of a large one.
    import zeroio.plan

    monkeypatch.setattr(zeroio.plan, "NVME_SUB_GROUP_SIZE", 16384)
    cfg, m = _files(tmp_path, gpu_bytes=10 * MB, host_bytes=4 * MB)
    out = tmp_path / "run"
    rc, s, err = _train(capsys, out, "--model-config", str(cfg), "--machine", str(m), "--json")
    assert rc == 0, err
    record = _engine_matches_plan(s, out)
    assert record["placement"] == "stage 3, optimizer on NVMe"
    zero = record["zero_optimization"]
    assert zero["offload_optimizer"]["nvme_path"] == str(out / "nvme")
    # the plan's host budget (90% of 4 MB for one rank) plus the device state, which on a CPU
    # rank lives in host memory too; the engine's store trained under exactly that budget
    device = record["plan"]["tiers"]["gpu"]["need_bytes"]
    assert zero["tiering"]["cpu_budget_bytes"] == int(0.9 * 4 * MB) + device
    assert s["tier_budgets"]["cpu"] == zero["tiering"]["cpu_budget_bytes"]
    # the moments are homed on NVMe; on this CPU rank the budget (with the device state) holds
    # them all, so they stay cached, are never written back, and are never read: they start as
    # zeros on a disk never written (docs/tiering.md; tests/test_nvme_path.py)
    assert s["offload_optimizer"] == "nvme" and s["tier_budgets"]["nvme"] > 0
    assert s["bytes_moved"].get("nvme->cpu", 0) == 0 == s["bytes_moved"].get("cpu->nvme", 0)


def test_machine_nothing_fits_stops_before_training_and_writes_nothing(tmp_path, capsys):
    cfg, m = _files(tmp_path, gpu_bytes=1 * MB)
    out = tmp_path / "run"
    rc, _, err = _train(capsys, out, "--model-config", str(cfg), "--machine", str(m))
    assert rc == 1
    line = [ln for ln in err.splitlines() if ln.strip()]
    assert len(line) == 1, err  # one message, no plan block, no progress
    assert "zeroio train: error: --plan: the model (393,856 parameters) does not fit" in line[0]
    assert "GPU memory (per GPU) overflows by 5,923,936 bytes" in line[0]
    assert "Nothing was trained" in line[0]
    assert not out.exists()  # the lock made the folder and took it away again


def test_plan_block_names_the_tiers_numbers_and_rejections(tmp_path, capsys):
    cfg, m = _files(tmp_path, gpu_bytes=12 * MB)
    rc, stdout, err = _run(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine",
                           str(m))
    assert rc == 0, err
    block = err[err.index("zeroio train --plan: machine"):err.index("zeroio train: ")]
    record = json.loads((tmp_path / "run" / PLAN_FILE).read_text())
    for words in ("GPU memory (per GPU)", "host memory (per node)",
                  "disk under the NVMe path (per node)"):
        assert words in block
    ratio = record["zero_optimization"]["offload_optimizer"]["ratio"]
    assert f"plan: stage 3, optimizer on the CPU (offload_optimizer.ratio {ratio:g})" in block
    assert "placements earlier in the list that do not fit:" in block and "overflows by" in block
    assert "GPU -> CPU" in block and "predicted step time:" in block
    assert f"{0.9 * 12 * MB / GB:10.2f}" in block  # the GPU's usable GB
    assert "applied: zero_optimization " + json.dumps(record["zero_optimization"],
                                                      sort_keys=True) in block
    # the closing lines: the measured step time beside the predicted one
    predicted = record["plan"]["step_s"]
    assert f"predicted {predicted:.3f} s (stage 3, optimizer on the CPU;" in stdout
    assert "step time: measured " in stdout


def test_quiet_prints_no_block(tmp_path, capsys):
    cfg, m = _files(tmp_path)
    rc, _, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine",
                        str(m), "--quiet")
    assert rc == 0 and "zeroio train --plan" not in err


def test_no_plan_keeps_the_built_in_placement(tmp_path, capsys):
    cfg, m = _files(tmp_path)
    out = tmp_path / "run"
    rc, s, err = _train(capsys, out, "--model-config", str(cfg), "--no-plan", "--json")
    assert rc == 0, err
    assert s["plan"] is None and not (out / PLAN_FILE).exists()
    assert (s["stage"], s["offload_param"], s["offload_optimizer"]) == (3, "nvme", "nvme")


def test_default_run_does_not_plan(tmp_path, capsys):
    out = tmp_path / "run"
    rc, s, err = _train(capsys, out, "--json")  # the built-in tiny preset, as before
    assert rc == 0, err
    assert s["plan"] is None and not (out / PLAN_FILE).exists()
    assert (s["stage"], s["offload_param"], s["offload_optimizer"]) == (3, "nvme", "nvme")


@pytest.mark.parametrize("extra, key", [
    (["--ratio", "0.5"], "--ratio 0.5 does not go with --plan"),
    (["--no-plan"], "describes the machine --plan plans for"),
])
def test_options_that_contradict_the_plan(tmp_path, capsys, extra, key):
    cfg, m = _files(tmp_path)
    rc, _, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine",
                        str(m), *extra)
    assert rc == 2 and key in err


def test_user_config_must_leave_the_placement_to_zeroio(tmp_path, capsys):
    cfg, m = _files(tmp_path)
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu"}}}))
    rc, _, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--config",
                        str(user), "--plan", "--machine", str(m))
    assert rc == 2 and "--plan chooses zero_optimization.stage" in err
    # one that leaves it (here: only the optimizer's settings) trains the planned placement
    user.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    rc, s, err = _train(capsys, tmp_path / "run2", "--model-config", str(cfg), "--config",
                        str(user), "--plan", "--machine", str(m), "--json")
    assert rc == 0, err
    assert s["plan"]["placement"] == "stage 2, all on the GPU" and s["stage"] == 2


def test_machine_gpus_must_match_the_ranks(tmp_path, capsys):
    cfg, m = _files(tmp_path, gpus=8)
    rc, _, err = _train(capsys, tmp_path / "run", "--model-config", str(cfg), "--machine", str(m))
    assert rc == 2 and "gpus = 8, but this run has 1 rank(s) per node" in err


@pytest.mark.slow
def test_two_ranks_train_the_plan_their_launcher_made(tmp_path):
    import os
    import subprocess
    import sys

    cfg, m = _files(tmp_path, gpus=2, gpu_bytes=7 * MB)
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zeroio.cli.main", "train", *ARGS[:-3], "--nproc", "2",
           "--no-checkpoint", "--output", str(out), "--model-config", str(cfg), "--machine",
           str(m), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["world_size"] == 2
    record = _engine_matches_plan(s, out)
    assert record["plan"]["machine"]["gpus"] == 2
