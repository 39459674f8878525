"""SIGTERM / SIGINT deferred to the step boundary (zeroio.preemption, `zeroio train`).

Fault injection: the signal is sent from inside an optimizer step and inside a checkpoint
write (the process signals itself there), and to the `zeroio train` launcher mid-run. The
references: a plain run of the same calls with no signal (masters, losses and the exported
model's bytes must be identical), the file system (no swap folder left), the exit status
shells give a process a signal ended (128 + the signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zeroio
from zeroio.preemption import deferred_signals
from zeroio.testing.multirank import outside_launcher_env, run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _config(nvme: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "nvme", "nvme_path": str(nvme)}}}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 6, generator=g) for _ in range(n)]


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _trained(nvme: Path, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of an uninterrupted run over ``batches``: what a signalled run must equal."""
    ref, *_ = zeroio.initialize(model=_model(), config=_config(nvme))
    for x in batches:
        ref.backward(ref(x).pow(2).mean())
        ref.step()
    expected = _params(ref)
    ref.close()
    return expected


def _signalling(call, sig: int):
    """``call`` that first sends ``sig`` to this process and gives its handler time to run,
    so that the signal arrives in the middle of what ``call`` is part of."""
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # the handler runs here
        return call(*args, **kwargs)
    return signalled


def test_the_context_records_restores_and_escalates_a_second_sigint():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with deferred_signals() as signals:
        assert not signals.stop_now() and signals.exit_code == 0
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end pytest here
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher forwarding the same preemption
        assert signals.received == signal.SIGTERM
        assert signals.stop_now() and signals.exit_code == 143
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with pytest.raises(KeyboardInterrupt), deferred_signals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C twice: the user insists
        time.sleep(1)
    assert signals.exit_code == 0  # no boundary agreed on a stop


def test_a_signal_inside_the_optimizer_step_lets_the_step_finish(tmp_path):
    """The process signals itself in the middle of the step: the step completes exactly as
    an unsignalled one, and the loop stops at the next boundary."""
    batches = _batches(4)
    expected = _trained(tmp_path / "ref", batches[:2])
    engine, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "run"))
    step_signalled = _signalling(engine.optimizer.step, signal.SIGTERM)
    done = 0
    with deferred_signals() as signals:
        for x in batches:
            if signals.stop_now():
                break
            engine.backward(engine(x).pow(2).mean())
            engine.step()  # the second one is signalled from inside
            done += 1
            engine.optimizer.step = step_signalled
    assert done == 2 and engine.global_steps == 2 and signals.exit_code == 143
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), expected, strict=True))
    engine.close()
    assert not list((tmp_path / "run").rglob("zeroio-swap-*"))


def test_a_signal_inside_a_checkpoint_write_lets_the_save_complete(tmp_path):
    from zeroio.checkpoint import engine_io

    engine, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "nvme"))
    x = _batches(1)[0]
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    expected = _params(engine)
    real_save = engine_io.save_checkpoint
    hits = []

    def save_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        hits.append(1)
        return real_save(*args, **kwargs)

    engine_io.save_checkpoint = save_signalled
    try:
        with deferred_signals() as signals:
            engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
    finally:
        engine_io.save_checkpoint = real_save
    assert hits and signals.received == signal.SIGTERM
    engine.close()
    fresh, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "nvme2"))
    path, _ = fresh.load_checkpoint(tmp_path / "ckpt")
    assert path is not None and fresh.global_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), expected, strict=True))
    fresh.close()


@pytest.fixture
def sigint_handler():
    """Sets SIGINT's handler for one test and puts back the one before. A process started in
    the background by a shell without job control (``cmd &``, nohup, some CI runners) begins
    with SIGINT ignored, and Python then leaves it ignored instead of raising
    KeyboardInterrupt: the tests name the handler they mean."""
    before = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, before)


def test_without_the_helper_a_sigint_in_a_step_is_raised_after_the_step(tmp_path,
                                                                        sigint_handler):
    """Python's own SIGINT handler stays; the engine holds the KeyboardInterrupt until the
    step and then the checkpoint write are whole."""
    sigint_handler(signal.default_int_handler)
    batches = _batches(2)
    expected = _trained(tmp_path / "ref", batches)
    engine, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "run"))
    engine.backward(engine(batches[0]).pow(2).mean())
    engine.step()
    engine.optimizer.step = _signalling(engine.optimizer.step, signal.SIGINT)
    engine.backward(engine(batches[1]).pow(2).mean())
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.global_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), expected, strict=True))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    from zeroio.checkpoint import engine_io

    real_save = engine_io.save_checkpoint
    engine_io.save_checkpoint = _signalling(real_save, signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint(tmp_path / "ckpt", tag="t2")
    finally:
        engine_io.save_checkpoint = real_save
    engine.close()
    fresh, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "fresh"))
    assert fresh.load_checkpoint(tmp_path / "ckpt", tag="t2")[0] is not None
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), expected, strict=True))
    fresh.close()


def test_an_ignored_sigint_stays_ignored_through_a_step(tmp_path, sigint_handler):
    """A process that ignores SIGINT (a background job) is not interrupted by the one the step
    held: the step and the next one complete, equal to an uninterrupted run, and SIGINT is
    still ignored afterwards."""
    sigint_handler(signal.SIG_IGN)
    batches = _batches(3)
    expected = _trained(tmp_path / "ref", batches)
    engine, *_ = zeroio.initialize(model=_model(), config=_config(tmp_path / "run"))
    engine.optimizer.step = _signalling(engine.optimizer.step, signal.SIGINT)
    for x in batches:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.global_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(_params(engine), expected, strict=True))
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    engine.close()


def _agree(signalled_rank: int) -> list[int]:
    """Rank ``signalled_rank`` alone gets SIGTERM; both must stop at the same boundary."""
    from zeroio.partition import collectives as comm

    answers = []
    with deferred_signals() as signals:
        for boundary in range(4):
            if boundary == 2 and comm.rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            stop = signals.stop_now()
            answers.append(int(stop))
            if stop:
                break
    return answers + [signals.exit_code]


def test_ranks_agree_on_the_boundary_when_one_rank_is_signalled():
    assert run_ranks(_agree, 2, 1) == [[0, 0, 1, 143], [0, 0, 1, 143]]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "zeroio.cli.main", "train", "--steps", "60", "--seq-len", "32",
         "--output", str(out), "--json", "--progress-every", "1", *extra],
        env=outside_launcher_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _stop_at(proc: subprocess.Popen, step: int, sig: int) -> tuple[str, str]:
    head = []
    for line in proc.stderr:
        head.append(line)
        if line.startswith(f"step {step}/"):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return out, "".join(head) + err


def _swap_left(out: Path) -> list[Path]:
    return [p for p in (out / "nvme").rglob("*") if p.is_file() or p.name.startswith("zeroio-swap")]


@pytest.mark.slow
def test_sigterm_to_zeroio_train_checkpoints_cleans_up_and_resumes_bit_exact(tmp_path):
    stopped = tmp_path / "stopped"
    out, err = _stop_at(_train(stopped, "--nproc", "2"), 4, signal.SIGTERM)
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    summary = json.loads(out)  # one JSON object, nothing else on stdout
    assert summary["stopped_by"] == "SIGTERM" and summary["exit_code"] == 143
    end = summary["end_step"]
    assert 4 <= end < 60, summary
    assert summary["checkpoint"].endswith(f"step{end}") and summary["model_dir"] is None
    assert f"zeroio train: stopped by SIGTERM after step {end} of 60" in err
    assert not _swap_left(stopped), _swap_left(stopped)
    assert (stopped / "checkpoints" / "latest").read_text().strip() == f"step{end}"

    resumed = _train(stopped, "--nproc", "2", "--resume")
    r_out, r_err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, r_err[-3000:]
    whole = _train(tmp_path / "whole", "--nproc", "2")
    w_out, w_err = whole.communicate(timeout=300)
    assert whole.returncode == 0, w_err[-3000:]
    r, w = json.loads(r_out), json.loads(w_out)
    assert r["start_step"] == end and r["losses"] == w["losses"]
    model = stopped / "model" / "model.safetensors"
    assert model.read_bytes() == (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_sigint_to_a_single_rank_run_stops_it_the_same_way(tmp_path):
    proc = _train(tmp_path / "run", "--nproc", "1", "--no-checkpoint-on-signal")
    out, err = _stop_at(proc, 3, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGINT" and summary["checkpoint"] is None
    assert "KeyboardInterrupt" not in err and "no checkpoint written" in err
    assert not _swap_left(tmp_path / "run")
    assert not list((tmp_path / "run" / "checkpoints").glob("step*"))


def test_the_launcher_reports_ranks_that_stopped_on_a_signal_as_a_stop():
    from types import SimpleNamespace as F

    from zeroio.cli.launch_cmd import signal_stop

    assert signal_stop({0: F(exitcode=143), 1: F(exitcode=143)}) == signal.SIGTERM
    assert signal_stop({0: F(exitcode=130)}) == signal.SIGINT
    assert signal_stop({0: F(exitcode=143), 1: F(exitcode=1)}) is None
    assert signal_stop({0: F(exitcode=143), 1: F(exitcode=130)}) is None
    assert signal_stop({0: F(exitcode=-15)}) is None
