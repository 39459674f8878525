"""DeepSpeed's launcher flags in `zeroio launch`: hostfile, --include/--exclude, --launcher,
core binding, the per-rank options. References: the examples and rules of DeepSpeed's runner
(``deepspeed/launcher/runner.py``, ``deepspeed/utils/numa.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeroio.cli.launch_cores import format_core_list, parse_core_list, rank_cores
from zeroio.cli.launch_hosts import filter_pool, parse_hostfile
from zeroio.cli.launch_plan import PerNodeCommands, plan_launch
from zeroio.cli.main import build_parser
from zeroio.errors import ConfigError
from zeroio.testing.multirank import free_port, outside_launcher_env
from zeroio.testing.train_cli import zeroio_here


def _args(*flags: str, script: str = "train.py", script_args=("--lr", "1")):
    return build_parser().parse_args(["launch", *flags, script, *script_args])


def test_hostfile_lines_as_deepspeed_reads_them():
    text = "# pool\nworker-0 slots=4\n\nworker-1 slots=2\n"
    assert parse_hostfile(text) == {"worker-0": 4, "worker-1": 2}
    with pytest.raises(ConfigError, match="line 2.*'worker-1 slot=2'"):
        parse_hostfile("worker-0 slots=4\nworker-1 slot=2\n")
    with pytest.raises(ConfigError, match="listed twice"):
        parse_hostfile("a slots=1\na slots=2\n")
    with pytest.raises(ConfigError, match="lists no host"):
        parse_hostfile("# nothing\n")


def test_include_and_exclude_follow_deepspeeds_examples():
    pool = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    # runner.py's own examples: all of worker-0 and slots 0, 2 of worker-1; all but worker-1:0
    assert filter_pool(pool, include="worker-0@worker-1:0,2") == \
        {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}
    assert filter_pool(pool, exclude="worker-1:0") == \
        {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}
    assert filter_pool(pool, exclude="worker-0") == {"worker-1": [0, 1, 2, 3]}
    with pytest.raises(ConfigError, match="mutually exclusive"):
        filter_pool(pool, include="worker-0", exclude="worker-1")
    with pytest.raises(ConfigError, match="'worker-9' is not in the pool"):
        filter_pool(pool, include="worker-9")
    with pytest.raises(ConfigError, match="no slot 7"):
        filter_pool(pool, include="worker-1:7")


def test_include_on_one_host_picks_gpus_and_the_process_count():
    plan = plan_launch(_args("--include", "localhost:1,3"), gpus=4)
    assert plan.nproc == 2 and plan.visible_devices == ["1", "3"] and plan.note is None
    # slot i is the i-th GPU this launcher sees
    plan = plan_launch(_args("--include", "localhost:1,3"), gpus=4, visible_env="2,4,5,7")
    assert plan.visible_devices == ["4", "7"]
    plan = plan_launch(_args("--exclude", "localhost:0"), gpus=4)
    assert plan.nproc == 3 and plan.visible_devices == ["1", "2", "3"]
    cpu = plan_launch(_args("--include", "localhost:0,1"), gpus=0)
    assert cpu.nproc == 2 and cpu.visible_devices is None
    assert "no CUDA" in cpu.note and "2 CPU rank(s)" in cpu.note
    with pytest.raises(ConfigError, match="no slot 4"):
        plan_launch(_args("--include", "localhost:4"), gpus=4)
    with pytest.raises(ConfigError, match="cannot be given with them"):
        plan_launch(_args("--include", "localhost:0", "--num_gpus", "2"), gpus=4)
    with pytest.raises(ConfigError, match="pool is this machine"):
        plan_launch(_args("--include", "worker-1:0"), gpus=4)


def test_hostfile_of_several_nodes_prints_each_nodes_command(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    with pytest.raises(PerNodeCommands) as e:
        plan_launch(_args("--hostfile", str(hf), "--no_local_rank"), gpus=4)
    msg = str(e.value)
    for r, host in enumerate(("worker-0", "worker-1")):
        assert (f"on {host}: zeroio launch --num_nodes 2 --node_rank {r} --nproc 4 "
                "--master_addr worker-0 --master_port 29500 --no_local_rank train.py --lr 1") in msg
    plan = plan_launch(_args("--hostfile", str(hf), "--node_rank", "1"), gpus=4)
    assert (plan.nnodes, plan.node_rank, plan.nproc, plan.master_addr, plan.master_port) == \
        (2, 1, 4, "worker-0", 29500)
    one = plan_launch(_args("--hostfile", str(hf), "--num_nodes", "1", "--num_gpus", "2"), gpus=4)
    assert (one.nnodes, one.nproc, one.visible_devices) == (1, 2, None)
    sub = plan_launch(_args("--hostfile", str(hf), "--include", "worker-1:2,3"), gpus=4)
    assert sub.nproc == 2 and sub.visible_devices == ["2", "3"]
    with pytest.raises(ConfigError, match="cannot read"):
        plan_launch(_args("--hostfile", str(tmp_path / "missing")), gpus=4)
    # the CLI: exit status 2 and the commands on stderr
    proc = zeroio_here(["launch", "--hostfile", str(hf), "t.py"])  # its own main, in this process
    assert proc.returncode == 2 and "on worker-1: zeroio launch" in proc.stderr


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi", "slurm", "MVAPICH"])
def test_other_launchers_are_refused_naming_what_zeroio_supports(launcher):
    with pytest.raises(ConfigError, match=r"--launcher torch.*does not drive pdsh"):
        plan_launch(_args("--launcher", launcher), gpus=0)
    assert plan_launch(_args("--launcher", "pytorch", "--nproc", "2"), gpus=0).nproc == 2


def test_core_lists_and_shares_follow_deepspeeds_rule():
    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert format_core_list([0, 2, 3, 4, 6]) == "0,2-4,6"
    cores = list(range(10))
    assert [rank_cores(cores, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for bad in ("3-1", "0,0", "a", "2,1"):
        with pytest.raises(ConfigError, match="bind_core_list"):
            parse_core_list(bad)
    with pytest.raises(ConfigError, match="at least one"):
        rank_cores([0], 2, 0)


def test_rank_options_from_deepspeed_flags():
    from zeroio.cli.launch_cmd import rank_options, torchrun_argv
    from zeroio.cli.rank import _options

    assert rank_options(_args(), None) == ["--local-rank-arg"]
    assert rank_options(_args("--no_local_rank", "--no_python"), "0-3") == \
        ["--bind-cores", "0-3", "--no-python"]
    with pytest.raises(ConfigError, match="--no_python and --module"):
        rank_options(_args("--no_python", "--module"), None)
    argv = torchrun_argv("t.py", ["--x"], nproc=2, master_port=1, guard=True,
                         rank_options=["--local-rank-arg"], module=True)
    assert argv[-6:] == ["--module", "zeroio.cli.rank", "--local-rank-arg", "-m", "t.py", "--x"]
    assert _options(["--local-rank-arg", "--bind-cores", "0,1", "-m", "pkg", "--bind-cores"]) == \
        ({"local_rank_arg": True, "bind_cores": "0,1"}, ["-m", "pkg", "--bind-cores"])
    from zeroio.cli.launch_cmd import _refuse_unsupported

    for flags in (["--autotuning", "tune"], ["--elastic_training"]):
        with pytest.raises(ConfigError, match="does not implement"):
            _refuse_unsupported(_args(*flags))


BIND_SCRIPT = """import json, os, sys
sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), "argv": sys.argv[1:],
    "cores": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_ranks_are_pinned_to_their_cores_and_get_local_rank(tmp_path):
    import os

    script = tmp_path / "show.py"
    script.write_text(BIND_SCRIPT)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    proc = subprocess.run(
        [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", "--master_port",
         str(free_port()), "--bind_cores_to_rank", "--bind_core_list", format_core_list(cores),
         str(script), "--x"], env=outside_launcher_env(), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["cores"] for r in rows] == [[cores[0]], [cores[1]]]
    assert all(r["omp"] == "1" for r in rows)
    assert [r["argv"] for r in rows] == [["--local_rank=0", "--x"], ["--local_rank=1", "--x"]]


@pytest.mark.slow
def test_no_python_executes_the_program_with_local_rank(tmp_path):
    prog = tmp_path / "show.sh"
    prog.write_text('#!/bin/sh\necho "rank=$RANK args=$*"\n')
    prog.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2", "--no_python",
         str(prog), "a", "b"], env=outside_launcher_env(), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank=")) == [
        "rank=0 args=--local_rank=0 a b", "rank=1 args=--local_rank=1 a b"]


def test_shim_folder_goes_first_on_the_ranks_path_only_when_it_holds_deepspeed(tmp_path,
                                                                              monkeypatch):
    import os

    import zeroio.deepspeed
    from zeroio.cli.launch_cmd import _shim_pythonpath

    shim = tmp_path / "_shim"
    monkeypatch.setattr(zeroio.deepspeed, "shim_dir", lambda: shim)
    monkeypatch.setenv("PYTHONPATH", f"/a{os.pathsep}/b")
    _shim_pythonpath()
    assert os.environ["PYTHONPATH"] == f"/a{os.pathsep}/b"  # no package there: untouched
    (shim / "deepspeed").mkdir(parents=True)
    (shim / "deepspeed" / "__init__.py").write_text("")
    _shim_pythonpath()
    _shim_pythonpath()  # idempotent
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(shim), "/a", "/b"]
