"""A run that finished its work exits 0: no SIGABRT at interpreter exit (zeroio/shutdown.py,
[Note: a clean exit]).

12 consecutive 2-rank gloo runs (6 of the API script, 6 of the Trainer's), each launcher in
turn (torchrun, `zeroio launch`, `accelerate launch`, two processes started by hand with the
launcher environment), of two small scripts that end right after their last ``step()`` with no
``close()`` (what users and the Hugging Face Trainer do): one through the Python API, one
through the Trainer with zeroio's one-import route. Both use CPU offload with the overlapped
host step, so the host step is still running when the script ends: before the fix, 5 runs in 6
of the API script aborted ("terminate called without an active exception", exit 134 per rank),
and about 1 in 6 of the Trainer's (a gloo worker of accelerate's world freeing the last
all-gather's tensors during finalization).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeroio.testing.multirank import free_port, outside_launcher_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux")]

REPO = Path(__file__).resolve().parents[1]
RUNS = 12  # every launcher runs each script at least once

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "tiering": {"overlap_step": True}}}

API_SCRIPT = textwrap.dedent("""
    import json, sys, torch, zeroio
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(6)])
    engine, *_ = zeroio.initialize(model=model, config=json.loads(sys.argv[1]))
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 768)).pow(2).mean())
        engine.step()
    print("trained", engine.global_steps, flush=True)
""")

HF_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from zeroio.integrations.transformers import Trainer, TrainingArguments

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    cfg = json.loads(sys.argv[1])
    cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    cfg["optimizer"]["params"]["lr"] = "auto"
    args = TrainingArguments(output_dir=sys.argv[2], deepspeed=cfg, per_device_train_batch_size=2,
                             max_steps=2, report_to="none", use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=256, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=32))
    Trainer(model=model, args=args, train_dataset=Blocks()).train()
    print("trained", flush=True)
""")


def _commands(launcher: str, script: Path, args: list[str]) -> list[list[str]]:
    """The command lines of one 2-rank run (one per process, or one for the launcher)."""
    port = str(free_port())
    if launcher == "torchrun":
        return [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                 f"--master-port={port}", str(script), *args]]
    if launcher == "zeroio":
        # the scripts read their arguments by position: no --local_rank (DeepSpeed's flag)
        return [[sys.executable, "-m", "zeroio.cli.main", "launch", "--nproc", "2",
                 "--no_local_rank", "--master-port", port, str(script), *args]]
    if launcher == "accelerate":
        return [[str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                 str(REPO / "configs/accelerate-zeroio.yaml"), "--main_process_port", port,
                 str(script), *args]]
    return [[sys.executable, str(script), *args, f"--rank={r}:{port}"] for r in range(2)]


def _env(command: list[str]) -> dict[str, str]:
    env = outside_launcher_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO)
    tail = command[-1]
    if tail.startswith("--rank="):  # by hand: the environment a launcher would set
        rank, port = tail[len("--rank="):].split(":")
        command.pop()
        env.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return env


def _run(launcher: str, script: Path, args: list[str], log: Path) -> list[tuple[int, str]]:
    """Start one 2-rank run; its processes' (exit status, output) once they have ended."""
    procs = []
    for k, cmd in enumerate(_commands(launcher, script, args)):
        env = _env(cmd)
        out = open(log.with_suffix(f".{k}"), "w+")  # a file: a full pipe would block the rank
        procs.append((subprocess.Popen(cmd, env=env, cwd=script.parent, stdout=out,
                                       stderr=subprocess.STDOUT, text=True), out))
    results = []
    for p, out in procs:
        code = p.wait(timeout=300)
        out.seek(0)
        results.append((code, out.read()))
        out.close()
    return results


@pytest.mark.timeout(1800)
def test_finished_runs_exit_zero_with_every_launcher(tmp_path):
    import json
    from concurrent.futures import ThreadPoolExecutor

    api, hf = tmp_path / "api.py", tmp_path / "hf.py"
    api.write_text(API_SCRIPT)
    hf.write_text(HF_SCRIPT)
    cfg = json.dumps(CONFIG)
    # accelerate first: the launcher whose world aborted most rarely gets the most runs
    launchers = ("accelerate", "torchrun", "zeroio", "by-hand")
    jobs = []
    for i in range(RUNS):
        launcher = launchers[(i // 2) % len(launchers)]  # each launcher runs both scripts
        script, args = (hf, [cfg, str(tmp_path / f"out{i}")]) if i % 2 else (api, [cfg])
        jobs.append((i, launcher, script, args))
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: their waits overlap
        ran = list(pool.map(lambda j: (j, _run(j[1], j[2], j[3], tmp_path / f"log{j[0]}")), jobs))
    failures = [f"run {i} ({script.stem}, {launcher}): exit {code}\n{out[-1500:]}"
                for (i, launcher, script, _), results in ran for code, out in results
                if code != 0 or "terminate called" in out or "trained" not in out]
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly:\n" + \
        "\n".join(failures[:3])


@pytest.mark.timeout(300)
def test_an_engine_left_open_is_closed_at_exit(tmp_path):
    """One process, no launcher (zeroio makes its world of one): the script ends without
    close(); at exit the hook closes the engine (its swap folder goes) and the process exits 0.
    A forked child exiting through atexit does not close its parent's engine."""
    script = tmp_path / "open.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, torch, zeroio
        from pathlib import Path
        nvme = Path({str(tmp_path / "nvme")!r})
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW",
               "params": {{"lr": 1e-3}}}}, "zero_optimization": {{"stage": 2,
               "offload_optimizer": {{"device": "nvme", "nvme_path": str(nvme)}}}}}}
        engine, *_ = zeroio.initialize(model=model, config=cfg)
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
        if os.fork() == 0:
            sys.exit(0)  # the child runs the atexit hooks it inherited
        os.wait()
        print("swap after the child", len(list(nvme.rglob("zeroio-swap-*"))), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], env=_env([sys.executable]),
                          capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "swap after the child 1" in proc.stdout
    assert not list((tmp_path / "nvme").rglob("zeroio-swap-*"))
