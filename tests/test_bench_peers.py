"""benchmarks/train_peers.py end to end on a tiny model on the CPU, and its pieces.

The end-to-end run launches the contenders that can run on a CPU (plain
PyTorch and zeroio through train_llama.py, FSDP2 with gloo) plus a DeepSpeed
one, which is a skip row here (not installed) or a real row where it is.
Checked against independent numbers: tokens/s against tokens per step / s
per step by hand; s/step against the median of the contender's own step
times (train_llama.py's result file); GB per tier pair against zeroio's raw
byte counters / steps; the markdown table against the JSON.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH / "peers"))
sys.path.insert(0, str(BENCH))

import launch  # noqa: E402
import report  # noqa: E402

TINY = ["--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4",
        "--vocab", "256", "--seq", "32", "--micro-batch", "2"]
STEPS, WARMUP = 4, 1
ONLY = "plain,zeroio-z2-cpu,zeroio-z3-nvme,ds-z3-nvme,fsdp2-cpu"


@pytest.fixture(scope="module")
def peers_run(tmp_path_factory):
    import train_peers

    out = tmp_path_factory.mktemp("results")
    # a host budget that holds a third of the NVMe row's moments, so that they stream (a
    # budget that holds them moves nothing: their first loads read zeros from no disk); pieces
    # are sub-groups of 16384 elements (a piece is never cut below 8 MiB by the budget alone,
    # and this model's whole state is smaller than that)
    doc = train_peers.main([*TINY, "--only", ONLY, "--steps", str(STEPS), "--warmup",
                            str(WARMUP), "--disk-bench-size", "0", "--out", str(out),
                            "--set", "zero_optimization.tiering.cpu_budget_bytes=1500000",
                            "--set", "zero_optimization.sub_group_size=16384",
                            "--nvme-dir", str(out / "nvme"), "--timeout", "240", "--json"])
    return doc, out


def test_rows_in_order_with_right_status(peers_run):
    doc, _ = peers_run
    rows = {r["name"]: r for r in doc["rows"]}
    assert [r["name"] for r in doc["rows"]] == ONLY.split(",")
    for name in ("plain", "zeroio-z2-cpu", "zeroio-z3-nvme", "fsdp2-cpu"):
        assert rows[name]["status"] == "ok", (name, rows[name]["reason"])
    ds = rows["ds-z3-nvme"]
    if importlib.util.find_spec("deepspeed") is None:
        assert ds["status"] == "skipped" and "deepspeed is not installed" in ds["reason"]
        assert ds["s_per_step"] is None
    else:  # on a CPU-only machine DeepSpeed may fail, but the row must say how
        assert ds["status"] == "ok" or ds["reason"]


def test_numbers_against_hand_computation(peers_run):
    doc, _ = peers_run
    tokens_per_step = 2 * 32  # micro batch x seq, one rank
    for r in doc["rows"]:
        if r["status"] != "ok":
            continue
        assert r["world"] == 1
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step / r["s_per_step"], rel=1e-9)
        assert r["s_per_step"] > 0 and r["peak_host_rss_gib"] > 0.05  # torch alone is >50 MiB
        assert r["peak_gpu_gib"] is None  # no CUDA here
    assert doc["run"]["num_params"] == 115_008  # hand count, see below
    h, i, v, layers = 64, 128, 256, 2
    assert layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h == 115_008


def test_s_per_step_is_median_of_contender_step_times(peers_run):
    doc, out = peers_run
    rows = {r["name"]: r for r in doc["rows"]}
    raw = {}
    for f in out.glob("peers-*/train_llama/*.json"):
        d = json.loads(f.read_text())
        raw[Path(d["config"]).stem if d["config"] else "plain"] = d
    assert set(raw) == {"plain", "zeroio-z2-cpu", "zeroio-z3-nvme"}
    for name, d in raw.items():
        assert len(d["step_times"]) == STEPS
        assert rows[name]["s_per_step"] == pytest.approx(
            statistics.median(d["step_times"][WARMUP:]), rel=1e-12)
    # GB per tier pair = zeroio's byte counters / optimizer steps / 1e9
    stats = raw["zeroio-z3-nvme"]["stats"]
    moved = rows["zeroio-z3-nvme"]["gb_moved_per_step"]
    assert set(moved) == set(stats["bytes_moved"]) and moved
    for pair, n in stats["bytes_moved"].items():
        assert moved[pair] == pytest.approx(n / stats["global_steps"] / 1e9)
    # the host budget holds a part of the moments: the rest stream, read and written back
    assert moved["nvme->cpu"] > 0 and moved["cpu->nvme"] > 0
    assert rows["zeroio-z2-cpu"]["gb_moved_per_step"] == {}


def test_zeroio_rows_carry_the_timed_steps_breakdown(peers_run):
    """train_llama.py's ``breakdown`` reaches the row: the last timed step's record and the mean
    of the timed steps; at stage 2 with CPU offload every parameter (the hand count) is stepped
    by CPU Adam in the host step's chunks; the plot is beside the JSON where matplotlib is."""
    doc, out = peers_run
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["plain"]["breakdown"] is None
    bd = rows["zeroio-z2-cpu"]["breakdown"]
    assert bd["steps"] == list(range(WARMUP + 1, STEPS + 1))
    assert bd["last"]["step"] == STEPS
    assert bd["last"]["numel_cpu"] == sum(c["numel"] for c in bd["last"]["chunks"]) == 115_008
    assert bd["mean"]["wall_s"] > 0 and bd["mean"]["numel_cpu"] == 115_008
    plots = [Path(p) for p in doc["breakdown_plots"]]
    if importlib.util.find_spec("matplotlib") is None:
        assert plots == []
        return
    names = {p.name for p in plots}
    assert {n.rsplit("-breakdown-", 1)[1] for n in names} >= {"zeroio-z2-cpu.png"}
    for p in plots:
        assert p.parent == out and p.read_bytes()[:4] == b"\x89PNG"


def test_markdown_and_json_written_with_provenance(peers_run):
    doc, out = peers_run
    jsons = list(out.glob("peers-*.json"))
    mds = list(out.glob("peers-*.md"))
    assert len(jsons) == 1 and len(mds) == 1
    on_disk = json.loads(jsons[0].read_text())
    assert on_disk["rows"] == json.loads(json.dumps(doc["rows"]))
    assert len(on_disk["provenance"]["commit"]) == 40
    assert on_disk["machine"]["cpu_count"] >= 1 and on_disk["machine"]["ram_gib"] > 0
    text = mds[0].read_text()
    assert "commit " + on_disk["provenance"]["commit"] in text
    table = report.parse_markdown_table(text)
    assert list(table[0]) == list(report.COLUMNS)
    by_name = {t["contender"]: t for t in table}
    for r in doc["rows"]:
        cell = by_name[r["name"]]
        assert cell["status"].startswith(r["status"])
        if r["status"] == "ok":
            assert float(cell["s/step"]) == pytest.approx(r["s_per_step"], abs=5e-4)
            assert float(cell["tokens/s"].replace(",", "")) == pytest.approx(
                r["tokens_per_s"], abs=0.5)


def test_timeout_and_failure_rows(tmp_path):
    import train_peers

    doc = train_peers.main([*TINY, "--only", "fsdp2-cpu", "--steps", "2", "--warmup", "1",
                            "--out", str(tmp_path), "--timeout", "1", "--json"])
    (row,) = doc["rows"]
    assert row["status"] == "timeout" and "1 s" in row["reason"] and row["s_per_step"] is None
    assert "| fsdp2-cpu |" in next(tmp_path.glob("peers-*.md")).read_text()

    py = sys.executable
    oom = launch.run([py, "-c", "raise RuntimeError('CUDA out of memory. Tried to allocate 2 GiB')"],
                     env={}, timeout=60, log_dir=tmp_path, name="oom")
    assert oom.status is launch.Status.FAILED and oom.reason.startswith("GPU out of memory")
    killed = launch.run([py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                        env={}, timeout=60, log_dir=tmp_path, name="kill")
    assert killed.reason.startswith("killed by SIGKILL (host out of memory?)")
    silent = launch.run([py, "-c", "print('no json')"], env={}, timeout=60, log_dir=tmp_path,
                        name="silent")
    assert silent.status is launch.Status.FAILED and "no JSON" in silent.reason


def test_last_json_picks_the_result_line():
    text = 'noise {"not": json\n{"a": 1}\nwarning: x\n{"b": 2}\ntrailing\n'
    assert launch.last_json(text) == {"b": 2}
    assert launch.last_json("nothing here") is None


def test_libaio_env(tmp_path):
    import contenders

    lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libaio.so.1").write_bytes(b"")
    (tmp_path / "usr" / "include").mkdir(parents=True)
    (tmp_path / "usr" / "include" / "libaio.h").write_text("")
    env = contenders.libaio_env(tmp_path, {"LD_LIBRARY_PATH": "/old"})
    assert env["CPATH"] == str(tmp_path / "usr" / "include")
    assert env["CFLAGS"] == f"-I{tmp_path / 'usr' / 'include'}"
    assert env["LDFLAGS"] == f"-L{lib}"
    assert env["LIBRARY_PATH"] == str(lib)
    assert env["LD_LIBRARY_PATH"] == f"{lib}:/old"
    with pytest.raises(SystemExit, match="libaio.h"):
        contenders.libaio_env(tmp_path / "missing", {})


def test_same_config_file_for_zeroio_and_deepspeed(tmp_path):
    import common
    import contenders as C

    plan = C.RunPlan(spec=common.ModelSpec(), steps=4, warmup=1, nproc=2, run_dir=tmp_path,
                     nvme_dir=tmp_path / "nvme")
    z = json.loads(C.config_path(C.BY_NAME["zeroio-z3-nvme"], plan).read_text())
    d = json.loads(C.config_path(C.BY_NAME["ds-z3-nvme"], plan).read_text())
    for cfg, name in ((z, "zeroio-z3-nvme"), (d, "ds-z3-nvme")):
        for key in ("offload_param", "offload_optimizer"):
            assert cfg["zero_optimization"][key]["nvme_path"] == str(tmp_path / "nvme" / name)
            cfg["zero_optimization"][key].pop("nvme_path")
    assert z == d
    assert z["train_batch_size"] == 16 and z["gradient_clipping"] == 1.0
    argv, _ = C.command(C.BY_NAME["ds-z2-cpu"], plan)
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=2" in argv
    argv, _ = C.command(C.BY_NAME["plain"], plan)  # train_llama's plain mode is one process
    assert "torch.distributed.run" not in argv


def test_deepspeed_alone_gets_the_launcher_environment(tmp_path):
    """One rank runs without torch.distributed.run; DeepSpeed asserts LOCAL_RANK anyway (the
    2026-11-29 H200 run failed with exactly that), so the harness sets the launcher's variables
    while leaving MASTER_ADDR unset (common.init_world then makes a world of one)."""
    import common
    import contenders as C

    plan = C.RunPlan(spec=common.ModelSpec(), steps=4, warmup=1, nproc=1, run_dir=tmp_path,
                     nvme_dir=tmp_path / "nvme")
    argv, env = C.command(C.BY_NAME["ds-z2-cpu"], plan)
    assert "torch.distributed.run" not in argv
    assert (env["LOCAL_RANK"], env["RANK"], env["WORLD_SIZE"]) == ("0", "0", "1")
    assert "MASTER_ADDR" not in env or "MASTER_ADDR" in __import__("os").environ


def test_set_applies_to_every_contender_config(tmp_path):
    """train_peers --set: the same key lands in zeroio's and DeepSpeed's config file."""
    import common
    import contenders as C
    import train_peers

    args = train_peers.parse_args(["--set", "zero_optimization.offload_optimizer.ratio=0.5",
                                   "--set", "zero_optimization.tiering.overlap_step=true"])
    plan = C.RunPlan(spec=common.ModelSpec(), steps=4, warmup=1, nproc=1, run_dir=tmp_path,
                     nvme_dir=tmp_path / "nvme", overrides=args.overrides)
    for name in ("zeroio-z3-cpu", "ds-z3-cpu"):
        cfg = json.loads(C.config_path(C.BY_NAME[name], plan).read_text())
        zero = cfg["zero_optimization"]
        assert zero["offload_optimizer"]["ratio"] == 0.5
        assert zero["offload_optimizer"]["device"] == "cpu"  # the rest of the section kept
        assert zero["tiering"]["overlap_step"] is True
    with pytest.raises(SystemExit):
        train_peers.parse_args(["--set", "zero_optimization.stage=three"])


def test_deepspeed_best_modes_are_the_cpu_config_plus_their_one_block(tmp_path):
    """ZenFlow, twin-flow and SuperOffload rows: DeepSpeed's stage-2/3 CPU config with only
    their documented keys added (so the rows differ from ZeRO-Offload's by that alone)."""
    import common
    import contenders as C

    plan = C.RunPlan(spec=common.ModelSpec(), steps=4, warmup=1, nproc=1, run_dir=tmp_path,
                     nvme_dir=tmp_path / "nvme")
    z2 = json.loads(C.config_path(C.BY_NAME["ds-z2-cpu"], plan).read_text())
    z3 = json.loads(C.config_path(C.BY_NAME["ds-z3-cpu"], plan).read_text())
    zen = json.loads(C.config_path(C.BY_NAME["ds-z2-zenflow"], plan).read_text())
    assert zen["zero_optimization"].pop("zenflow") == {
        "topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
        "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
    assert zen == z2
    twin = json.loads(C.config_path(C.BY_NAME["ds-z3-twinflow"], plan).read_text())
    assert twin["zero_optimization"]["offload_optimizer"].pop("ratio") == 0.8
    assert twin["zero_optimization"].pop("sub_group_size") == 100_000_000
    assert twin == z3
    sup = json.loads(C.config_path(C.BY_NAME["ds-z3-superoffload"], plan).read_text())
    assert sup["zero_optimization"]["offload_optimizer"].pop("super_offload") is True
    assert sup == z3
    argv, _ = C.command(C.BY_NAME["torchao-cpu"], plan)
    assert argv[1].endswith("torchao_runner.py")


def test_zenflow_step_time_is_the_mean_over_whole_update_windows():
    """Hand computation: update_interval 4, 14 steps; step 3 (0-based) is the first update,
    the whole windows after it are steps 4..7 and 8..11; steps 12, 13 are a partial window."""
    import ds_runner

    times = [9.0, 0.2, 0.2, 1.5, 0.2, 0.2, 0.2, 1.6, 0.3, 0.3, 0.3, 1.4, 0.2, 0.2]
    out = ds_runner.zenflow_summary(times, {"update_interval": 4}, tokens_per_step=100)
    assert out["zenflow_windows"] == 2
    assert out["s_per_step"] == pytest.approx(sum(times[4:12]) / 8)
    assert out["tokens_per_s"] == pytest.approx(100 / out["s_per_step"])
    short = ds_runner.zenflow_summary(times[:6], {"update_interval": 4}, tokens_per_step=100)
    assert short["zenflow_windows"] == 0 and "partial" in short["zenflow_note"]
    assert short["s_per_step"] == pytest.approx(0.2)
    assert "s_per_step" not in ds_runner.zenflow_summary(times, {"update_interval": "auto"}, 1)
