"""DeepSpeed users' command-line habits: --version, `zeroio report`, launch's flag aliases, and
`zeroio train`'s one check before launching (exit 2) with an --nproc that fits the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import zeroio
from zeroio.cli.ports import free_port
from zeroio.testing.multirank import outside_launcher_env
from zeroio.testing.train_cli import train_here, zeroio_here


def _env() -> dict[str, str]:
    return outside_launcher_env()


def _zeroio(*args: str, cwd: Path | None = None, timeout: int = 180):
    return subprocess.run([sys.executable, "-m", "zeroio.cli.main", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def test_version_is_the_package_version():
    proc = _zeroio("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"zeroio {zeroio.__version__}"
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert f'version = "{zeroio.__version__}"' in pyproject.read_text()
    try:
        assert metadata.version("zeroio") == zeroio.__version__
    except metadata.PackageNotFoundError:
        pass


def _fs_type(path: Path) -> str:
    """The file system type as coreutils' stat names it (independent of /proc/mounts)."""
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True, check=True).stdout.strip()


def _dd_direct(path: Path) -> bool:
    """Whether dd can write a block with O_DIRECT in ``path`` (independent probe)."""
    target = path / "dd-probe"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4096", "count=1",
                           "oflag=direct"], capture_output=True)
    target.unlink(missing_ok=True)
    return proc.returncode == 0


@pytest.mark.skipif(shutil.which("stat") is None or shutil.which("dd") is None,
                    reason="needs coreutils stat and dd")
def test_report_json_states_the_machine_and_the_path(tmp_path):
    import resource

    paths = [tmp_path] + ([Path("/dev/shm")] if Path("/dev/shm").is_dir() else [])
    for path in paths:
        proc = zeroio_here(["report", "--path", str(path), "--json"])  # its main, in this process
        assert proc.returncode == 0, proc.stderr
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        assert len(lines) == 1
        r = json.loads(lines[0])
        import torch

        assert r["zeroio"] == zeroio.__version__ and r["torch"] == torch.__version__
        assert r["cuda"] == torch.version.cuda
        assert r["transformers"] == metadata.version("transformers")
        assert len(r["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        assert r["pinned_memory_limit"]["soft_bytes"] == (
            None if soft == resource.RLIM_INFINITY else soft)
        assert r["cpu"]["cores"] == os.cpu_count() and r["cpu"]["host_step_threads"] >= 1
        assert r["cpu_adam"]["mode"] in ("auto", "compiled", "torch")
        p = r["path"]
        fs = _fs_type(path)
        assert p["filesystem"] == fs or (fs, p["filesystem"]) == ("ext2/ext3", "ext4"), (fs, p)
        free = shutil.disk_usage(path).free
        assert abs(p["free_bytes"] - free) < 1 << 30  # a shared disk: others write meanwhile
        assert p["o_direct"] == _dd_direct(path)
        assert not [f for f in os.listdir(path) if f.startswith(".zeroio-report-")]


def test_report_table_and_a_bad_path(tmp_path):
    proc = zeroio_here(["report", "--path", str(tmp_path)])  # its own main, in this process
    assert proc.returncode == 0
    for word in ("torch", "pinned-memory limit", "host step threads", "CPU Adam kernel",
                 "O_DIRECT", "free space"):
        assert word in proc.stdout
    bad = zeroio_here(["report", "--path", str(tmp_path / "missing")])
    assert bad.returncode == 2 and "missing is not a directory" in bad.stderr


def test_launch_accepts_deepspeed_and_torchrun_spellings(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        keys = ("RANK", "WORLD_SIZE", "MASTER_PORT", "ZEROIO_LAUNCHER_PID")
        # one write of one line (< PIPE_BUF): the two ranks share the pipe, and print's
        # separate write of the newline could land after the other rank's line
        os.write(1, (json.dumps({k: os.environ.get(k) for k in keys}
                                | {"argv": sys.argv[1:]}) + "\\n").encode())
    """))
    port = free_port()
    proc = _zeroio("launch", "--num_gpus", "2", "--master_port", str(port), str(script),
                   "--x", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")),
                  key=lambda r: r["RANK"])
    assert [r["RANK"] for r in rows] == ["0", "1"]
    assert all(r["WORLD_SIZE"] == "2" and r["MASTER_PORT"] == str(port) for r in rows)
    # DeepSpeed's launcher passes --local_rank=N before the script's own arguments
    assert all(r["argv"] == [f"--local_rank={r['RANK']}", "--x", "1"] and r["ZEROIO_LAUNCHER_PID"]
               for r in rows)


@pytest.mark.parametrize("flags", [
    ["--num_gpus", "3", "--num_nodes", "2", "--master_port", "1234", "--master_addr", "h",
     "--node_rank", "1"],
    ["--num-gpus", "3", "--num-nodes", "2", "--master-port", "1234", "--master-addr", "h",
     "--node-rank", "1"],
    ["--nproc_per_node", "3", "--nnodes", "2", "--master-port", "1234", "--master-addr", "h",
     "--node-rank", "1"],
])
def test_launch_alias_spellings_parse_alike(flags):
    from zeroio.cli.main import build_parser

    args = build_parser().parse_args(["launch", *flags, "s.py", "--lr", "1"])
    assert (args.nproc, args.nnodes, args.master_port, args.master_addr, args.node_rank) == \
        (3, 2, 1234, "h", 1)
    assert args.script == "s.py" and args.script_args == ["--lr", "1"]


def test_train_config_errors_are_found_once_before_launch(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"stage": 3, "reduce_bucket_sise": 10}}))
    # refused before any rank starts: the command's own main, in this process
    proc = train_here(tmp_path / "run", ["--config", str(bad), "--nproc", "2"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "zero_optimization.reduce_bucket_sise" in errors[0], proc.stderr
    assert "torch.distributed" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, words", [
    (["--micro-batch", "3"], "micro"),
    (["--timeout", "5"], "--timeout 5 contradicts distributed.timeout_s = 30"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_train_argument_errors_exit_2_before_launch(tmp_path, capsys, extra, words):
    from zeroio.cli.main import main

    good = tmp_path / "ok.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "distributed": {"timeout_s": 30}}))
    config = [] if "--timeout" in extra and "0" in extra else ["--config", str(good)]
    rc = main(["train", *config, *extra, "--nproc", "2", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()


def test_train_nproc_defaults_to_the_visible_gpus(monkeypatch):
    import torch

    from zeroio.cli.train_cmd import default_nproc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_nproc() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_nproc() == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert default_nproc() == 8


def test_train_timeout_reaches_the_config(tmp_path):
    from zeroio.cli.train.loop import TrainOptions, check_options, resolve_config

    opts = TrainOptions(timeout=7.5, output=str(tmp_path))
    cfg = resolve_config(opts, check_options(opts), world_size=2, cuda=False, out=tmp_path)
    assert cfg.distributed.timeout_s == 7.5
    plain = TrainOptions(output=str(tmp_path))
    assert resolve_config(plain, check_options(plain), world_size=2, cuda=False,
                          out=tmp_path).distributed.timeout_s == 600.0
