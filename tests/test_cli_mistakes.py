"""User mistakes on the command line of `zeroio launch`, `bench io`, `tune io`, `estimate` and
`consolidate`: each one is exit status 2 and one line naming the flag or file (argparse's
usage errors: the usage of the command that was given, then that line), no traceback, and no
file or folder made. A value is refused, never turned into another (`--gpus-per-node 0` is
not a 1-GPU estimate, `--max-shard-size 0` is not one shard per tensor). `zeroio.initialize`
refuses a model with nothing to train."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import zeroio
from zeroio.testing.train_cli import zeroio_here


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _refused(argv: list[str], cwd: Path, *words: str) -> str:
    """Run ``zeroio argv`` in ``cwd``: exit 2, a last stderr line "zeroio <cmd>: error: ..."
    holding ``words``, no traceback, and nothing under ``cwd`` created or changed. The line."""
    before = _tree(cwd)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        proc = zeroio_here(argv)
    finally:
        os.chdir(old)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and lines, proc.stderr
    errors = [ln for ln in lines if ": error: " in ln]
    assert len(errors) == 1 and errors[0] == lines[-1], proc.stderr
    assert errors[0].startswith(f"zeroio {argv[0]}"), errors[0]
    for w in words:
        assert w in errors[0], (w, errors[0])
    assert _tree(cwd) == before, "the refused command created or changed files"
    return errors[0]


@pytest.fixture()
def work(tmp_path) -> Path:
    (tmp_path / "disk").mkdir()
    (tmp_path / "ok.py").write_text("print('ran')\n")
    (tmp_path / "broken.json").write_text('{"aio": {"block_size": 4096,}')
    (tmp_path / "latin1.json").write_bytes(b'{"name": "caf\xe9"}')
    (tmp_path / "shape0.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 0, "num_attention_heads": 4, "vocab_size": 256}))
    return tmp_path


@pytest.mark.parametrize("argv, words", [
    (["launch", "missing.py"], ["missing.py", "does not exist"]),
    (["launch", "--master_port", "99999", "ok.py"], ["--master_port 99999"]),
    (["launch", "--nproc", "1", "disk"], ["disk", "__main__.py"]),
    (["launch", "--no_python", "no-such-program-here", "--x"], ["no-such-program-here"]),
    (["launch", "--bind_cores_to_rank", "--bind_core_list", "100000", "ok.py"],
     ["--bind_core_list", "100000"]),
    (["launch", "--master_addr", " ", "ok.py"], ["--master_addr"]),
    (["bench", "io", "--path", "disk", "--size", "0"], ["--size", "4096"]),
    (["bench", "io", "--path", "disk", "--size", "5000"], ["--size", "4096"]),
    (["bench", "io", "--path", "disk", "--size", "1M", "--config", "broken.json"],
     ["--config broken.json", "not valid JSON"]),
    (["bench", "io", "--path", "disk", "--size", "1M", "--config", "missing.json"],
     ["--config missing.json"]),
    (["bench", "io", "--path", "nowhere", "--size", "1M"], ["--path nowhere"]),
    (["bench", "io", "--path", "disk", "--size", "1M", "--fio", "/no/fio"], ["--fio"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--write-config", "broken.json"],
     ["--write-config broken.json", "not valid JSON"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--write-config", "latin1.json"],
     ["--write-config latin1.json", "UTF-8"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--write-config", "no/dir/a.json"],
     ["--write-config"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--block-sizes", ""], ["--block-sizes"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--queue-depths", "4,x"],
     ["--queue-depths"]),
    (["tune", "io", "--path", "disk", "--size", "1M", "--threads", "0"], ["--threads"]),
    (["estimate", "--params", "1B", "--gpus-per-node", "0"], ["--gpus-per-node", "0"]),
    (["estimate", "--params", "1B", "--nodes", "0"], ["--nodes"]),
    (["estimate", "--params", "1B", "--micro-batch", "2"], ["--micro-batch", "--plan"]),
    (["estimate", "--model-config", "shape0.json"], ["shape0.json", "num_hidden_layers"]),
    (["estimate", "--plan", "--params", "1B", "--gpu-mem", "80", "--host-mem", "100",
      "--disk-free", "100", "--pcie-gbps", "20", "--disk-read-gbps", "3",
      "--disk-write-gbps", "2", "--cpu-adam-gelems", "1", "--seq", "0"], ["--seq"]),
    (["estimate", "--plan", "--params", "1B", "--gpu-mem", "nan", "--host-mem", "100",
      "--disk-free", "100", "--pcie-gbps", "20", "--disk-read-gbps", "3",
      "--disk-write-gbps", "2", "--cpu-adam-gelems", "1"], ["--gpu-mem"]),
    (["consolidate", "ck", "out", "--max-shard-size", "0"], ["--max-shard-size"]),
    (["consolidate", "missing", "out"], ["missing", "does not exist"]),
    (["consolidate", "ck", "out", "--tag", "../x"], ["--tag", "not allowed"]),
])
def test_mistakes_exit_2_naming_the_flag_and_leave_nothing(work, argv, words):
    if argv[0] == "consolidate" and argv[1] == "ck":
        (work / "ck").mkdir()
    _refused(argv, work, *words)


def test_an_unknown_flag_shows_the_usage_of_the_command_given(work, capsys):
    for argv, usage in ((["launch", "--bogus", "ok.py"], "usage: zeroio launch"),
                        (["bench", "io", "--path", "disk", "--bogus"], "usage: zeroio bench io")):
        line = _refused(argv, work, "unrecognized arguments: --bogus")
        err = zeroio_here(argv).stderr
        assert err.startswith(usage) and "COMMAND" not in err, err
        assert line.startswith(f"zeroio {' '.join(argv[:2 if argv[0] == 'bench' else 1])}:")
    for argv in (["bench"], ["tune"]):  # a command without its subcommand: its help, exit 2
        proc = zeroio_here(argv)
        assert proc.returncode == 2 and f"usage: zeroio {argv[0]}" in proc.stderr


def test_tune_writes_into_a_good_config_and_keeps_its_keys(work):
    cfg = work / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8}))
    proc = zeroio_here(["tune", "io", "--path", str(work / "disk"), "--size", "64K",
                        "--block-sizes", "64K", "--queue-depths", "1", "--threads", "1",
                        "--write-config", str(cfg), "--json", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    written = json.loads(cfg.read_text())
    assert written["train_batch_size"] == 8 and written["aio"]["block_size"] == 64 << 10


def test_estimate_and_train_refuse_a_model_config_with_the_same_words(work):
    """One check of the model config: `estimate` and `train` (planned or not) say the same."""
    from zeroio.testing.train_cli import train_here

    est = _refused(["estimate", "--model-config", "shape0.json"], work)
    want = est.split(": error: ", 1)[1]
    for plan in ("--plan", "--no-plan"):
        proc = train_here(work / "run", ["--model-config", str(work / "shape0.json"), plan,
                                         "--nproc", "1"])
        assert proc.returncode == 2, proc.stderr
        got = proc.stderr.strip().splitlines()[-1].split(": error: ", 1)[1]
        assert got == want.replace("shape0.json", str(work / "shape0.json")), (got, want)
    assert not (work / "run").exists()


def _frozen_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def test_initialize_refuses_a_model_with_nothing_to_train():
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match="nothing to train") as e:
        zeroio.initialize(model=_frozen_model(), config=config)
    assert isinstance(e.value, zeroio.ConfigError) and "requires_grad" in str(e.value)
    client = {k: v for k, v in config.items() if k != "optimizer"}
    with pytest.raises(zeroio.ConfigError, match="nothing to train"):  # a client optimizer too
        model = _frozen_model()
        zeroio.initialize(model=model, config=client,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    # DeepSpeed's API builds a frozen model, as DeepSpeed does (TRL's reference model)
    import zeroio.deepspeed as deepspeed

    ref = _frozen_model()
    x = torch.randn(3, 4)
    want = ref(x)
    wrapped, *_ = deepspeed.initialize(model=ref, config=config)
    assert torch.equal(wrapped(x), want)
    wrapped.close()  # the zeroio engine under the adapter
    # one trainable parameter is enough: it trains, the frozen ones stay as they were
    model = _frozen_model()
    model[1].weight.requires_grad_(True)
    frozen = model[0].weight.detach().clone()
    engine, *_ = zeroio.initialize(model=model, config=config)
    before = engine.module[1].weight.detach().clone()
    loss = engine(torch.ones(1, 4)).sum()
    engine.backward(loss)
    engine.step()
    assert not torch.equal(engine.module[1].weight.detach(), before)
    assert torch.equal(engine.module[0].weight.detach(), frozen)
    engine.close()
