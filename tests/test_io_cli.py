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
    assert main(["bench", "io", "--path", str(tmp_path / "missing"), "--size", "1M"]) == 1
    assert "not a directory" in capsys.readouterr().err
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
