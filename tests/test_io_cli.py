"""`zeroio bench io`, `zeroio tune io` and the benchmark script (the copy helpers: test_tiering_streams.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroio.cli.main import main
from zeroio.io.bench import parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_size():
    assert parse_size("4G") == 4 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("100MB") == 100_000_000 and parse_size("4096") == 4096


def test_bench_io_json(tmp_path, capsys):
    rc = main(["bench", "io", "--path", str(tmp_path), "--size", "8M", "--threads", "2",
               "--block-size", "256K", "--raw", "dd", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("engine", "raw"):
        assert out[side]["read_gbps"] > 0 and out[side]["write_gbps"] > 0
    assert out["settings"]["block_size"] == 256 << 10 and out["settings"]["thread_count"] == 2
    assert out["ratio"]["read"] == pytest.approx(out["engine"]["read_gbps"] / out["raw"]["read_gbps"])
    assert os.listdir(tmp_path) == []  # test files removed


def test_bench_io_errors(tmp_path, capsys):
    # a mistake on the command line: exit 2 naming the flag
    assert main(["bench", "io", "--path", str(tmp_path / "missing"), "--size", "1M"]) == 2
    assert "--path" in capsys.readouterr().err
    assert main(["bench", "io", "--path", str(tmp_path), "--size", "1000T"]) == 1
    assert "bytes free" in capsys.readouterr().err


def test_tune_io_writes_best_aio_block(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "aio": {"block_size": 4096}}))
    data = tmp_path / "data"
    data.mkdir()
    rc = main(["tune", "io", "--path", str(data), "--size", "4M", "--block-sizes", "64K,256K",
               "--queue-depths", "2,4", "--threads", "1,2", "--write-config", str(cfg), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["trials"]) == 8
    best = max(out["trials"], key=lambda r: 2 / (1 / r["write_gbps"] + 1 / r["read_gbps"]))
    written = json.loads(cfg.read_text())
    assert written["train_batch_size"] == 8  # the rest of the config kept
    assert written["aio"] == out["aio"]
    assert (written["aio"]["block_size"], written["aio"]["queue_depth"], written["aio"]["intra_op_parallelism"]) == (
        best["block_size"], best["queue_depth"], best["thread_count"])


def test_benchmark_script_runs_on_cpu(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_io.py"), "--path",
                          str(tmp_path / "d"), "--size", "4M", "--out", str(tmp_path / "res"), "--quiet",
                          "--raw", "dd"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (name,) = os.listdir(tmp_path / "res")
    rec = json.loads((tmp_path / "res" / name).read_text())
    assert rec["commit"] and rec["date"] and rec["machine"]["host"]
    assert rec["disk"]["engine"]["read_gbps"] > 0 and rec["disk"]["raw"]["read_gbps"] > 0


_FAKE_FIO = r'''#!{python}
import json, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
qd, jobs, rw = int(args["iodepth"]), int(args["numjobs"]), args["rw"]
# made-up disk: reads scale with depth x jobs up to 6 GB/s, writes peak at depth 4, 1 job
speed = {{"read": min(6.0, 0.5 * qd * jobs), "write": 3.0 if (qd, jobs) == (4, 1) else 1.5}}
total = int(args["size"]) * jobs
out = {{}}
for side in ("read", "write"):
    share = {{"read": 1.0, "write": 0.0, "rw": 0.5}}[rw] if side == "read" else \
        {{"read": 0.0, "write": 1.0, "rw": 0.5}}[rw]
    nbytes = int(total * share)
    ms = nbytes / (speed[side] * 1e9) * 1000 if nbytes else 0
    out[side] = {{"io_bytes": nbytes, "runtime": ms}}
print("fio-3.33 banner line")
print(json.dumps({{"jobs": [out]}}))
'''


def _fake_fio(tmp_path):
    log = tmp_path / "fio-calls.log"
    exe = tmp_path / "fio"
    exe.write_text(_FAKE_FIO.format(python=sys.executable, log=str(log)))
    exe.chmod(0o755)
    return exe, log


def test_bench_io_fio_sweep_takes_the_best_of_each_direction(tmp_path, capsys):
    """The raw side is fio's best over queue depths x jobs, each direction on its own, every
    run O_DIRECT libaio sequential with jobs on disjoint regions; a hand-made disk whose best
    read (depth 16 x 1 job or deeper, 6 GB/s) and best write (depth 4, 1 job, 3 GB/s) differ."""
    from zeroio.io.bench import FIO_BLOCKS, FIO_JOBS, FIO_QUEUE_DEPTHS, disk_bound_s

    exe, log = _fake_fio(tmp_path)
    data = tmp_path / "disk"
    data.mkdir()
    size = 64 << 20
    rc = main(["bench", "io", "--path", str(data), "--size", "64M", "--raw", "fio", "--fio",
               str(exe), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    raw = out["raw"]
    assert raw["read_gbps"] == pytest.approx(6.0, rel=0.01)
    assert raw["write_gbps"] == pytest.approx(3.0, rel=0.01)
    assert (raw["best"]["write"]["iodepth"], raw["best"]["write"]["numjobs"]) == (4, 1)
    assert 0.5 * raw["best"]["read"]["iodepth"] * raw["best"]["read"]["numjobs"] >= 6.0
    assert len(raw["sweep"]) == 2 * len(FIO_BLOCKS) * len(FIO_QUEUE_DEPTHS) * len(FIO_JOBS)
    assert {r["block_size"] for r in raw["sweep"]} == set(FIO_BLOCKS)
    assert raw["mixed"]["read_gbps"] == pytest.approx(6.0, rel=0.01)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == len(raw["sweep"]) + 1  # the sweep, then the mixed job
    for argv in calls:
        assert "--direct=1" in argv and "--ioengine=libaio" in argv
        assert any(a.startswith("--runtime=") for a in argv)
        jobs = int(next(a for a in argv if a.startswith("--numjobs=")).split("=")[1])
        per_job = int(next(a for a in argv if a.startswith("--size=")).split("=")[1])
        assert per_job * jobs <= size  # the jobs share the file's bytes, not each the whole
        if jobs > 1:
            assert f"--offset_increment={per_job}" in argv
        if any(a in argv for a in ("--rw=write", "--rw=rw")):
            assert "--end_fsync=1" in argv
    # the disk bound: reads at the best read, writes at the best write, one after the other
    assert disk_bound_s(12e9, 6e9, raw) == pytest.approx(12 / 6.0 + 6 / 3.0, rel=0.01)
    text_rc = main(["bench", "io", "--path", str(data), "--size", "64M", "--fio", str(exe),
                    "--quiet"])
    assert text_rc == 0
    assert "fio best of 32 runs: write at iodepth 4 x 1 jobs x 1 MiB" in capsys.readouterr().out


def test_bench_io_sustained_runs_fio_untimed_over_its_size(tmp_path, capsys):
    """--sustained: after the sweep, one write, one read and one mixed fio run over a file of
    that size, at the sweep's best settings, with no time limit; the made-up disk's rates at
    those settings come back, and the file is gone."""
    exe, log = _fake_fio(tmp_path)
    data = tmp_path / "disk"
    data.mkdir()
    rc = main(["bench", "io", "--path", str(data), "--size", "16M", "--fio", str(exe),
               "--sustained", "48M", "--json"])
    assert rc == 0
    raw = json.loads(capsys.readouterr().out)["raw"]
    su = raw["sustained"]
    assert su["size_bytes"] == 48 << 20
    assert su["write_gbps"] == pytest.approx(3.0, rel=0.01)  # depth 4, 1 job: the best write
    assert su["read_gbps"] == pytest.approx(6.0, rel=0.01)
    assert su["mixed"]["read_gbps"] == pytest.approx(6.0, rel=0.01)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    tail = calls[-3:]  # the sweep and its mixed job first, then these three
    assert [next(a for a in argv if a.startswith("--rw=")) for argv in tail] == \
        ["--rw=write", "--rw=read", "--rw=rw"]
    for argv in tail:
        assert not any(a.startswith("--runtime=") for a in argv)
        assert any(a.endswith("zeroio-bench-sustained.bin") for a in argv)
        jobs = int(next(a for a in argv if a.startswith("--numjobs=")).split("=")[1])
        per_job = int(next(a for a in argv if a.startswith("--size=")).split("=")[1])
        assert per_job * jobs == 48 << 20
    assert os.listdir(data) == []
    assert main(["bench", "io", "--path", str(data), "--size", "16M", "--fio", str(exe),
                 "--sustained", "48M", "--quiet"]) == 0
    assert "fio over 48 MiB, no time limit: write 3.000, read 6.000" in capsys.readouterr().out
    assert main(["bench", "io", "--path", str(data), "--size", "16M", "--raw", "dd",
                 "--sustained", "48M"]) == 1
    assert "--sustained runs fio" in capsys.readouterr().err


def test_bench_io_fio_report_it_cannot_read_names_the_tool(tmp_path, capsys):
    exe = tmp_path / "fio"
    exe.write_text(f"#!{sys.executable}\nprint('no json here')\n")
    exe.chmod(0o755)
    data = tmp_path / "disk"
    data.mkdir()
    assert main(["bench", "io", "--path", str(data), "--size", "1M", "--fio", str(exe)]) == 1
    assert "cannot read fio's JSON report" in capsys.readouterr().err
    assert os.listdir(data) == []


@pytest.mark.skipif(not __import__("shutil").which("fio"), reason="fio is not installed")
def test_bench_io_real_fio(tmp_path, capsys):
    assert main(["bench", "io", "--path", str(tmp_path), "--size", "32M", "--raw", "fio",
                 "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)["raw"]
    assert raw["read_gbps"] == max(r["gbps"] for r in raw["sweep"] if r["rw"] == "read") > 0
    assert os.listdir(tmp_path) == []
