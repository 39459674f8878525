"""zeroio's switches: ``ZEROIO_*`` overrides read only by the config layer, shown in
``Config.to_dict()``; launch variables through ``LaunchEnv``; the collectives that replaced
direct torch.distributed calls (op names, reduce, bytes broadcast) on gloo ranks."""

from __future__ import annotations

import pytest

from zeroio.config import load_config
from zeroio.config.launch_env import LaunchEnv
from zeroio.errors import ConfigError
from zeroio.testing import run_ranks
from zeroio.testing.multirank import outside_launcher_env

BASE = {"train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
ZEROIO_VARS = ("ZEROIO_OVERLAP_STEP", "ZEROIO_STEP_ASSIST", "ZEROIO_STEP_CHUNK_NUMEL",
               "ZEROIO_CPU_ADAM", "ZEROIO_STEP_THREADS")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ZEROIO_VARS:
        monkeypatch.delenv(name, raising=False)


def test_no_override_no_record():
    d = load_config(BASE).to_dict()
    assert "env_overrides" not in d
    assert d["zero_optimization"]["tiering"]["overlap_step"] is None  # "auto"
    assert d["zero_optimization"]["tiering"]["step_chunk_numel"] == 1 << 26


def test_key_overrides_land_in_the_key_and_show_in_to_dict(monkeypatch):
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "yes")
    monkeypatch.setenv("ZEROIO_STEP_ASSIST", "0")
    monkeypatch.setenv("ZEROIO_STEP_CHUNK_NUMEL", " 4096 ")
    cfg = load_config({**BASE, "zero_optimization": {
        **BASE["zero_optimization"], "tiering": {"overlap_step": False, "step_assist": True}}})
    t = cfg.zero_optimization.tiering
    assert (t.overlap_step, t.step_assist, t.step_chunk_numel) == (True, False, 4096)
    d = cfg.to_dict()
    assert d["zero_optimization"]["tiering"]["overlap_step"] is True
    assert d["env_overrides"] == {
        "ZEROIO_OVERLAP_STEP": {"value": True, "key": "zero_optimization.tiering.overlap_step"},
        "ZEROIO_STEP_ASSIST": {"value": False, "key": "zero_optimization.tiering.step_assist"},
        "ZEROIO_STEP_CHUNK_NUMEL": {"value": 4096,
                                    "key": "zero_optimization.tiering.step_chunk_numel"}}
    # the record is informational: to_dict() loads back to the same values without the env
    for name in ZEROIO_VARS:
        monkeypatch.delenv(name, raising=False)
    again = load_config(d)
    assert again.zero_optimization.tiering == t and not again.env_overrides


def test_process_overrides_show_in_to_dict_and_reach_their_readers(monkeypatch):
    from zeroio.optim import cpu_adam_plan
    from zeroio.partition.step_overlap import cpu_share, step_threads

    assert cpu_adam_plan.mode() == "auto" and step_threads() == cpu_share()
    assert cpu_adam_plan.planned(cpu_adam_plan.AUTO_MIN_NUMEL) is True
    monkeypatch.setenv("ZEROIO_CPU_ADAM", "Torch")
    monkeypatch.setenv("ZEROIO_STEP_THREADS", "3")
    assert cpu_adam_plan.mode() == "torch" and step_threads() == 3
    assert cpu_adam_plan.planned(cpu_adam_plan.AUTO_MIN_NUMEL) is False
    d = load_config(BASE).to_dict()
    assert d["env_overrides"] == {"ZEROIO_CPU_ADAM": {"value": "torch", "key": None},
                                  "ZEROIO_STEP_THREADS": {"value": 3, "key": None}}


@pytest.mark.parametrize("name, value", [("ZEROIO_STEP_ASSIST", "maybe"),
                                         ("ZEROIO_STEP_CHUNK_NUMEL", "-1"),
                                         ("ZEROIO_CPU_ADAM", "fastest"),
                                         ("ZEROIO_STEP_THREADS", "zero")])
def test_bad_override_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        load_config(BASE)
    assert e.value.key == name and repr(value) in str(e.value)


def test_a_malformed_section_is_still_reported_under_an_override(monkeypatch):
    monkeypatch.setenv("ZEROIO_OVERLAP_STEP", "1")
    with pytest.raises(ConfigError) as e:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": "stage 2"})
    assert e.value.key == "zero_optimization"


def test_launch_env_reads_the_launch_variables():
    env = LaunchEnv.read({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "CXX": "clang++",
                          "ACCELERATE_MIXED_PRECISION": "no", "HOME": "/root"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.launched and env.cxx == "clang++"
    assert "HOME" not in env.variables and env.variables["ACCELERATE_MIXED_PRECISION"] == "no"
    bare = LaunchEnv.read({"LOCAL_WORLD_SIZE": "x"})
    assert not bare.launched and bare.local_rank == 0 and bare.local_world_size is None
    with pytest.raises(ConfigError) as e:
        LaunchEnv.read({"LOCAL_RANK": "first"})
    assert e.value.key == "LOCAL_RANK"


def _collectives_body():
    import torch

    from zeroio.partition import collectives as comm

    w = comm.world()
    x = torch.tensor([float(w.rank + 1)])
    lo, hi = x.clone(), x.clone()
    comm.all_reduce_scalar(lo, op="min")
    comm.all_reduce_scalar(hi, op="max")
    comm.all_reduce(x).wait()
    red = comm.reduce(torch.tensor([float(10 * (w.rank + 1))]), 0)
    text = comm.broadcast_bytes("héllo".encode() if w.rank == 1 else b"ignored", src=1)
    empty = comm.broadcast_bytes(b"", src=0)
    return {"world": (w.rank, w.world_size, w.backend), "sum": x.item(), "min": lo.item(),
            "max": hi.item(), "reduce": red.item() if w.rank == 0 else None,
            "text": text.decode(), "empty": empty}


def test_collectives_on_two_ranks():
    out = run_ranks(_collectives_body, 2)
    assert [o["world"] for o in out] == [(0, 2, "gloo"), (1, 2, "gloo")]
    for o in out:
        assert (o["sum"], o["min"], o["max"]) == (3.0, 1.0, 2.0)
        assert o["text"] == "héllo" and o["empty"] == b""
    assert out[0]["reduce"] == 30.0


def test_world_of_one_without_a_process_group():
    """In a fresh interpreter: tests before this one in the same process may have left a
    process group behind (an in-process ``zeroio train --nproc 1``)."""
    import subprocess
    import sys

    code = (
        "from zeroio.partition import collectives as comm\n"
        "assert not comm.is_initialized() and comm.backend() is None\n"
        "assert comm.world() == comm.World(rank=0, world_size=1, backend=None)\n"
        "assert comm.broadcast_bytes(b'x') == b'x'\n"
        "try:\n"
        "    comm._op('avg')\n"
        "except ValueError as e:\n"
        "    assert \"reduction 'avg'\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error for avg')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=outside_launcher_env())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
