"""`zeroio train`'s user mistakes ([Note: checked before anything is written] in
zeroio/cli/train/options.py): with `--nproc 2` each one is found by the process that would
launch the ranks (the command's own main, in this process: no rank starts), is exit status 2
with one line naming the flag or file, and leaves nothing behind: no run folder, no
checkpoints/ or nvme/ (nor swap folders). A bad value is refused, never turned into another
(`--micro-batch 0` is not 4, `--save-every -1` does not save every step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroio.testing.train_cli import train_here, zeroio_here

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 256}


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _one_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zeroio train: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture()
def files(tmp_path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    for name, change in (("layers0", {"num_hidden_layers": 0}), ("hidden66", {"hidden_size": 66}),
                         ("foobar", {"model_type": "foobar"}), ("kv3", {"num_key_value_heads": 3})):
        (d / f"{name}.json").write_text(json.dumps({**LLAMA, **change}))
    (d / "empty.txt").write_bytes(b"")
    (d / "two.txt").write_bytes(b"hi")
    (d / "nothing").mkdir()
    (d / "huge-batch.json").write_text('{"train_micro_batch_size_per_gpu": 1e40}')
    (d / "a-file").write_text("x")
    (d / "keep5.json").write_text('{"checkpoint": {"keep_last": 5}}')
    return d


@pytest.mark.parametrize("args, words", [
    (["--model-config", "{in}/layers0.json"], ["layers0.json", "num_hidden_layers is 0"]),
    (["--model-config", "{in}/layers0.json", "--no-plan"], ["layers0.json", "num_hidden_layers"]),
    (["--model-config", "{in}/hidden66.json", "--no-plan"], ["hidden66.json", "hidden_size"]),
    (["--model-config", "{in}/foobar.json"], ["foobar.json", "model_type", "'foobar'"]),
    (["--model-config", "{in}/kv3.json", "--no-plan"], ["kv3.json", "num_key_value_heads"]),
    (["--save-every", "-1"], ["--save-every", "-1"]),
    (["--micro-batch", "0"], ["--micro-batch", "0"]),
    (["--data", "{in}/empty.txt"], ["empty.txt", "empty"]),
    (["--data", "{in}/two.txt"], ["two.txt", "2 tokens", "--seq-len 128"]),
    (["--data", "{in}/nothing"], ["nothing", "no text files"]),
    (["--seq-len", "0"], ["--seq-len", "0"]),
    (["--config", "{in}/huge-batch.json"], ["train_micro_batch_size_per_gpu",
                                             "huge-batch.json"]),
    (["--resume"], ["--resume", "no complete checkpoint"]),
    (["--resume", "--tag", "step5"], ["--tag step5", "does not exist"]),
    (["--tag", "step5"], ["--tag step5", "--resume"]),
    (["--progress-every", "-1"], ["--progress-every"]),
    (["--warmup", "-3"], ["--warmup"]),
    (["--lr", "nan"], ["--lr"]),
    (["--stop-after", "0"], ["--stop-after"]),
    (["--preset", ""], ["--preset"]),
    (["--nvme-path", "{in}/a-file"], ["--nvme-path", "a-file"]),
    (["--nproc", "0"], ["--nproc"]),
    (["--keep-last", "0"], ["--keep-last", "0"]),
    (["--keep-last", "2", "--no-checkpoint"], ["--no-checkpoint", "--keep-last"]),
    (["--keep-last", "2", "--config", "{in}/keep5.json"],
     ["--keep-last 2 contradicts checkpoint.keep_last = 5", "keep5.json"]),
])
def test_a_mistake_is_found_before_launch_and_leaves_nothing(tmp_path, files, args, words):
    before = _tree(files)
    out = tmp_path / "run"
    argv = [a.replace("{in}", str(files)) for a in args]
    proc = train_here(out, [*argv, *([] if "--nproc" in argv else ["--nproc", "2"])])
    assert proc.returncode == 2, proc.stderr
    line = _one_error(proc.stderr)
    for w in words:
        assert w in line, (w, line)
    assert not out.exists(), _tree(out)
    assert _tree(files) == before


def test_resume_without_a_checkpoint_keeps_the_folder_as_it_was(tmp_path):
    """An existing run folder without a complete checkpoint: refused, and no nvme/ (swap
    folders) or lock left in it."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step3").mkdir(parents=True)  # not a zeroio checkpoint
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    proc = train_here(out, ["--resume", "--nproc", "2"])
    assert proc.returncode == 2, proc.stderr
    assert "no complete checkpoint" in _one_error(proc.stderr)
    assert _tree(out) == before


def test_an_empty_output_is_refused_not_taken_as_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = zeroio_here(["train", "--output", "", "--nproc", "2"])
    assert proc.returncode == 2 and "--output is empty" in _one_error(proc.stderr)
    assert list(tmp_path.iterdir()) == []


def test_the_micro_batch_is_the_one_typed_or_the_default():
    """No ``or``-default: --micro-batch and --grad-accum reach the config as typed; only an
    absent option takes the default (4 and 1)."""
    from zeroio.cli.train.options import TrainOptions, check_options
    from zeroio.cli.train.run_config import resolve_config

    def resolved(**kw):
        opts = TrainOptions(**kw, given=frozenset(kw))
        cfg = resolve_config(opts, check_options(opts), world_size=2, cuda=False)
        return cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps

    assert resolved() == (4, 1)
    assert resolved(micro_batch=1, grad_accum=3) == (1, 3)
    with pytest.raises(ValueError, match="--micro-batch must be >= 1"):
        resolved(micro_batch=0)
    with pytest.raises(ValueError, match="--grad-accum must be >= 1"):
        resolved(grad_accum=0)
