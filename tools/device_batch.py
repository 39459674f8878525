"""Named GPU batches for the device tool: set up, run, summarise, pack results into $OUT.

    # here: what a batch runs, its timeouts, and the exact `run` tool parameters
    python tools/device_batch.py --list
    python tools/device_batch.py peers-zeroio --dry-run
    python tools/device_batch.py peers-zeroio --print-run        # JSON: command, carry, kind
    # on the device machine (the `run` command; the commit comes from here, it has no .git)
    ZEROIO_COMMIT=<sha> python3 tools/device_batch.py peers-zeroio --out $OUT

Each batch fits one `run` call (600 s limit): the sum of its step timeouts
plus setup stays under BATCH_BUDGET_S, sized from the 2026-11-29 H200 times
(1.36B build ~30 s; s/step plain 0.22, zeroio z2-cpu 0.63, z3-cpu 0.72,
z3-nvme 7.5, FSDP2 ~1.45; DeepSpeed's CPU-Adam JIT compile 1-2 min). Every
step runs in its own process group with its own deadline, its output
streams to the console and to a log; after every step the staging folder
is packed again into ``$OUT/<batch>.tar.gz`` with ``$OUT/<batch>-summary.md``
beside it, so a run cut off at the limit still brings back what finished
(two files: the tool returns at most 8, 16 MiB each).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from procs import kill_group  # noqa: E402  (benchmarks/procs.py, standard library only)

REPO = Path(__file__).resolve().parent.parent
BATCH_BUDGET_S = 540
"""Setup + every step's timeout; leaves 60 s of the tool's 600 for packing and slack."""
RUN_TIMEOUT_S = 600
MAX_COMMAND_CHARS = 2000
LOG_CAP_BYTES = 2 << 20
"""Logs above this are cut to their last LOG_CAP_BYTES before packing."""
STAGE = Path("/tmp/zeroio-batch")
NVME = Path("/tmp/zeroio-batch-nvme")
"""Swap folders on the machine's disk (not under STAGE: they are never packed)."""

PEERS = "python3 benchmarks/train_peers.py --steps 8 --warmup 2 --quiet --nvme-dir {nvme} --out {res}"
LIBAIO = "--libaio-dir /tmp/libaio"
PEERS6 = PEERS.replace("--steps 8", "--steps 6")
OVERLAP = "--set zero_optimization.tiering.overlap_step=true"
LLAMA = "python3 benchmarks/train_llama.py --steps 6 --warmup 2 --quiet --out {res}"


class Kind(enum.Enum):
    H200 = "nvidia-h200"
    H200_X2 = "nvidia-h200-x2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    shell: str
    """bash command; {res} = this batch's results folder, {nvme} = swap folder, {logs}."""
    timeout_s: int
    sized: str
    """How the timeout was sized (shown by --dry-run)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    name: str
    kind: Kind
    what: str
    steps: tuple[Step, ...]
    peers: bool = False
    """Install DeepSpeed and its deps from .peers/ and unpack libaio (carry .peers)."""

    @property
    def setup_s(self) -> int:
        return 60 if self.peers else 30

    @property
    def total_s(self) -> int:
        return self.setup_s + sum(s.timeout_s for s in self.steps)

    @property
    def carry(self) -> list[str]:
        return [".whl", ".peers"] if self.peers else [".whl"]


def _row(contender: str, timeout_s: int, *, sized: str, name: str | None = None,
         inner: int | None = None, steps: int = 6, prefix: str = "", overlap: bool = False,
         extra: str = "") -> Step:
    """A train_peers row of one contender: its own --timeout ``inner`` (default 5 s inside the
    step's), DeepSpeed rows with the unpacked libaio, zeroio rows with ``overlap`` the
    overlapped step."""
    shell = (prefix + (PEERS if steps == 8 else PEERS6) + f" --only {contender} "
             f"--timeout {inner if inner is not None else timeout_s - 5}"
             + (f" {LIBAIO}" if contender.startswith("ds-") else "")
             + (f" {OVERLAP}" if overlap else "") + (f" {extra}" if extra else ""))
    return Step(name=name or contender, shell=shell, timeout_s=timeout_s, sized=sized)


def _pytest(node: str) -> str:
    return f"python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml {{res}}/junit-{{step}}.xml {node}"


STAGE3_16BIT = Step(name="stage3-16bit", shell=_pytest("tests/test_stage3_16bit_grads.py"),
                    timeout_s=60, sized="26-30 s (session 5, calls 5 and 6); the 2-GPU case "
                                        "skips; a fresh host's first kernel compile adds 14 s")
"""Stage 3's 2-byte host gradient GPU tests: in gpu1-tests-b and the batches that re-ran them."""


# the -m gpu files that no longer fit gpu1-tests (gpu1-tests-b, check6)
GPU1_B = (
    STAGE3_16BIT,
    Step(name="stage3-linear", shell=_pytest("tests/test_stage3_linear.py"),
         timeout_s=45, sized="34 s (session 5, call 1)"),
    Step(name="step-assist", shell=_pytest("tests/test_step_assist.py"),
         timeout_s=130, sized="102 s with the slots-do-not-fit case (session 6, "
                              "call 5)"),
)

BATCHES: tuple[Batch, ...] = (
    Batch(name="gpu1-tests", kind=Kind.H200, what="every -m gpu test on 1 GPU (2-GPU ones skip)",
          steps=(
              Step(name="io", shell=_pytest("tests/test_io_cli.py"), timeout_s=30,
                   sized="copy helpers: seconds"),
              Step(name="stats", shell=_pytest("tests/test_stats.py"), timeout_s=50,
                   sized="one spawned rank, tiny model"),
              Step(name="hotpath", shell=_pytest("tests/test_stage3_hotpath.py"), timeout_s=60,
                   sized="small model, a few steps"),
              Step(name="stage3-1gpu", shell=_pytest("tests/test_stage3_gpu.py"), timeout_s=70,
                   sized="stage 3 equivalence cases on 1 GPU (two-GPU test skips): 35 s in "
                         "session 3"),
              Step(name="ratio-1gpu", shell=_pytest("tests/test_ratio_gpu.py"), timeout_s=60,
                   sized="offload_optimizer.ratio 0.5, 3 cases on 1 GPU: 33 s in session 3"),
              Step(name="stage12-ratio-1gpu", shell=_pytest("tests/test_stage12_ratio.py"),
                   timeout_s=60, sized="stage 2 at ratio 0.5, bf16, overlapped step, tiny MLP"),
              Step(name="cpu-adam-1gpu", shell=_pytest("tests/test_cpu_adam_training.py"),
                   timeout_s=70, sized="4 tiny-Llama cases + the compiled CPU Adam's first "
                                        "compile on that host (unmeasured: > 40 s once)"),
              Step(name="stage12", shell=_pytest("tests/test_stage12_equivalence.py"),
                   timeout_s=20, sized="skips on 1 GPU; collection only"),
          )),
    Batch(name="gpu1-tests-b", kind=Kind.H200,
          what="the rest of the -m gpu tests on 1 GPU (gpu1-tests is full; 2-GPU ones skip)",
          steps=GPU1_B),
    Batch(name="gpu2-tests", kind=Kind.H200_X2,
          what="NCCL equivalence stage 1/2 and 3 on 2 GPUs, stage 2's ratio and stage 3's 2-byte "
               "host gradients on 2 GPUs, zeroio train 1b on 2 GPUs",
          steps=(
              Step(name="stage12-nccl",
                   shell=_pytest("tests/test_stage12_equivalence.py::"
                                 "test_matches_single_process_adamw_nccl"),
                   timeout_s=70, sized="stages 0/1/2 x cases on 2 ranks (41 s in session 2)"),
              Step(name="stage3-nccl",
                   shell=_pytest("tests/test_stage3_gpu.py::test_stage3_two_gpus_nccl"),
                   timeout_s=70, sized="stage 3 cases on 2 ranks (40 s in session 2)"),
              Step(name="stage12-ratio-nccl",
                   shell=_pytest("tests/test_stage12_ratio.py::test_gpu_stage2_ratio_bf16_overlap"),
                   timeout_s=45, sized="stage 2 at ratio 0.5 on 1 and 2 GPUs, tiny MLP"),
              Step(name="stage3-16bit-nccl",
                   shell=_pytest("tests/test_stage3_16bit_grads.py::"
                                 "test_16bit_host_grads_stage3_gpu"),
                   timeout_s=45, sized="tiny Llama, 1 and 2 GPUs (27 s on 1, session 4)"),
              Step(name="ratio-nccl",
                   shell=_pytest("tests/test_ratio_gpu.py::test_ratio_two_gpus_nccl"),
                   timeout_s=80, sized="ratio 0.5, 3 cases on 2 ranks"),
              Step(name="train-1b-2gpu",
                   shell="python3 benchmarks/bench_train.py --preset 1b --nprocs 2 --steps 8 "
                         "--seq-len 512 --micro-batch 4 --progress-every 1 --timeout 190 "
                         "--output {nvme}/train --out {res}",
                   timeout_s=200, sized="build 30 s + 8 x <=7.5 s nvme steps + save 40 s"),
          )),
    Batch(name="peers-zeroio", kind=Kind.H200,
          what="1.36B: plain, zeroio z2-cpu, z3-cpu, z3-nvme (+ zeroio bench io on that disk)",
          steps=(
              _row("plain", 90, sized="build 30 s + 8 x 0.22 s", inner=80, steps=8),
              _row("zeroio-z2-cpu", 120, sized="build 30 s + init + 8 x 0.63 s", inner=110,
                   steps=8),
              _row("zeroio-z3-cpu", 120, sized="build 30 s + init + 8 x 0.72 s", inner=110,
                   steps=8),
              _row("zeroio-z3-nvme", 180, sized="bench io 2G ~20 s; build 30 s + 8 x 7.5 s + init",
                   inner=160, steps=8, extra="--disk-bench-size 2G"),
          )),
    Batch(name="peers-others", kind=Kind.H200, peers=True,
          what="1.36B: FSDP2 cpu offload, DeepSpeed z2-cpu, z3-cpu (CPU-Adam JIT once)",
          steps=(
              _row("fsdp2-cpu", 120, sized="build 30 s + 8 x 1.45 s + start", inner=110, steps=8),
              _row("ds-z2-cpu", 240, sized="CPU-Adam JIT 1-2 min + build 30 s + 8 x 0.9 s",
                   inner=230, steps=8),
              _row("ds-z3-cpu", 120, sized="JIT cached (TORCH_EXTENSIONS_DIR) + 8 x 1.1 s",
                   inner=110, steps=8),
          )),
    Batch(name="peers-ds-nvme", kind=Kind.H200, peers=True,
          what="1.36B: DeepSpeed z3-nvme with libaio (async_io JIT), bench io on the same disk",
          steps=(
              _row("ds-z3-nvme", 460, sized="bench io 20 s + CPU-Adam and async_io JIT 3 min + "
                                        "build 60 s + 8 steps of unknown length",
                   inner=440, steps=8, extra="--disk-bench-size 2G"),
          )),
    Batch(name="train-1b", kind=Kind.H200,
          what="zeroio train --preset 1b, stage 3 + NVMe (built-in config), 1 GPU, progress streamed",
          steps=(
              Step(name="train-1b",
                   shell="python3 benchmarks/bench_train.py --preset 1b --nprocs 1 --steps 30 "
                         "--seq-len 512 --micro-batch 4 --progress-every 1 --timeout 440 "
                         "--output {nvme}/train --out {res}",
                   timeout_s=460, sized="build 30 s + 30 x 7.5 s + checkpoint 22 GB ~20 s + "
                                        "consolidate ~20 s"),
          )),
    Batch(name="probe", kind=Kind.H200,
          what="largest-model probe: the estimate's plan, then one depth (--probe-layers)",
          steps=(
              Step(name="plan", shell="python3 benchmarks/probe_largest.py --plan-only "
                                      "--nvme-dir {nvme}/probe | tee {res}/probe-plan.json",
                   timeout_s=30, sized="estimate only"),
              Step(name="probe",
                   shell="python3 benchmarks/probe_largest.py --nvme-dir {nvme}/probe "
                         "--max-tries 1 --timeout 460 --out {res}{probe_layers}",
                   timeout_s=475, sized="fp32 build of 5B ~2 min + partition + 3 steps"),
          )),
    Batch(name="speed", kind=Kind.H200,
          what="1.36B, where the step goes: plain, zeroio z2/z3 + cpu, each with and without "
               "the overlapped step (tiering.overlap_step), synced phases + profiler op tables",
          steps=(
              Step(name="plain", shell=LLAMA + " --mode plain", timeout_s=55,
                   sized="build 25 s + 9 x 0.22 s"),
              Step(name="z2-cpu", shell=LLAMA + " --mode zeroio --config configs/zero2-cpu.json "
                                                "--profile {res}/prof", timeout_s=90,
                   sized="build 25 s + init 15 s + 9 x 0.7 s + profiler"),
              Step(name="z2-cpu-overlap", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero2-cpu.json --set zero_optimization.tiering.overlap_step=true",
                   timeout_s=75, sized="build 25 s + init 15 s + 6 x 0.7 s"),
              Step(name="z3-cpu", shell=LLAMA + " --mode zeroio --config configs/zero3-cpu.json "
                                                "--profile {res}/prof", timeout_s=105,
                   sized="zero.Init build 40 s + 9 x 0.8 s + profiler"),
              Step(name="z3-cpu-overlap", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --set zero_optimization.tiering.overlap_step=true",
                   timeout_s=85, sized="zero.Init build 40 s + 6 x 0.8 s"),
              Step(name="z3-cpu-overlap-64m", shell="ZEROIO_STEP_CHUNK_NUMEL=67108864 " + LLAMA
                   + " --mode zeroio --config configs/zero3-cpu.json --set "
                   "zero_optimization.tiering.overlap_step=true", timeout_s=85,
                   sized="as z3-cpu-overlap, CPU Adam in 64M-element chunks"),
          )),
    Batch(name="nvme", kind=Kind.H200,
          what="1.36B through the disk: z3 + nvme (cached; streaming with bench io), z2 + nvme; "
               "zeroio train --preset 1b on 1 GPU",
          steps=(
              Step(name="z3-nvme", shell=LLAMA + " --mode zeroio --config configs/zero3-nvme.json",
                   timeout_s=90, sized="build 40 s + 6 x 0.75 s"),
              _row("zeroio-z3-nvme-stream", 170,
                   sized="bench io 2 GB ~20 s + build 40 s + 8 x ~10 s (moments through the disk)",
                   name="z3-nvme-stream", inner=150, steps=8, extra="--disk-bench-size 2G"),
              Step(name="z2-nvme", shell=LLAMA + " --mode zeroio --config configs/zero2-cpu.json "
                   "--offload nvme --nvme-path {nvme}/z2 --steps 4 --warmup 1", timeout_s=100,
                   sized="build 25 s + 4 x <= 6.6 s"),
              Step(name="train-1b", shell="python3 benchmarks/bench_train.py --preset 1b "
                   "--nprocs 1 --steps 6 --seq-len 512 --micro-batch 4 --progress-every 1 "
                   "--timeout 140 --output {nvme}/train --out {res}", timeout_s=150,
                   sized="build 30 s + 6 x <= 7.5 s + checkpoint + consolidate"),
          )),
    Batch(name="peers-1gpu", kind=Kind.H200, peers=True,
          what="issue 9's table in one call: zeroio z2/z3 + cpu (overlap_step), FSDP2, "
               "DeepSpeed z2/z3 + cpu, 6 steps each (ratios within one run are what count)",
          steps=(
              Step(name="zeroio-z2-cpu", shell=PEERS6 + " --only zeroio-z2-cpu --timeout 75 "
                   f"{OVERLAP}", timeout_s=80, sized="build 25 s + init 10 s + CPU Adam "
                                                      "compile ~10 s + 6 x 0.55 s"),
              Step(name="zeroio-z3-cpu", shell=PEERS6 + " --only zeroio-z3-cpu --timeout 80 "
                   f"{OVERLAP}", timeout_s=85, sized="build 30 s + init 10 s + CPU Adam "
                                                      "compile ~10 s + 6 x 0.71 s"),
              _row("fsdp2-cpu", 75, sized="build 30 s + 6 x 1.4 s + start (53 s measured)"),
              _row("ds-z2-cpu", 160, sized="CPU-Adam JIT 1-2 min + build 30 s + 6 x 0.9 s"),
              _row("ds-z3-cpu", 65, sized="JIT cached + build 30 s + 6 x 1.1 s"),
          )),
)
RATIO_SET = ("--set zero_optimization.offload_optimizer.ratio={r} "
             "--set zero_optimization.tiering.overlap_step=true")
PROBE_13B = ("--hidden 5120 --intermediate 13824 --heads 40 --vocab 32000 --start-layers 40 "
             "--gpu-gib 139 --ram-gib 125 --disk-gib 60 --fraction 0.95")
"""The 13B Llama of issue 9 (13.02 B parameters) and the machine's nominal capacity."""
PLAN_13B = ("python3 benchmarks/probe_largest.py --plan-only " + PROBE_13B
            + " --nvme-dir {nvme}/probe --write-config {res}/cfg-13b.json"
            " | tee {res}/probe-plan-13b.json")
"""The estimate's plan for the 13B, and its config (the plan's ratio) for TRAIN_13B."""
TRAIN_13B = ("python3 benchmarks/train_llama.py --mode zeroio --config {res}/cfg-13b.json "
             "--zero-init --mem-log --hidden 5120 --intermediate 13824 --heads 40 --vocab 32000 "
             "--layers 40 --seq 1024 --micro-batch 1 --steps 3 --warmup 1 --quiet --out {res}")
"""3 steps of the 13B with the plan's config, memory printed after build / init / every step."""
RATIO_BATCHES = (
    Batch(name="ratio", kind=Kind.H200,
          what="offload_optimizer.ratio (stage 3 twin placement): 1.364B z3-cpu with the "
               "overlapped step at ratio 0.5 and 0.25, and the 13B plan from the estimate",
          steps=(
              Step(name="plan-13b", shell="python3 benchmarks/probe_largest.py --plan-only "
                   + PROBE_13B + " --nvme-dir {nvme}/probe | tee {res}/probe-plan-13b.json",
                   timeout_s=30, sized="estimate only"),
              Step(name="z3-cpu-ratio-0.5", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --zero-init --mem-log " + RATIO_SET.format(r=0.5),
                   timeout_s=110, sized="zero.Init build ~40 s + 6 x <= 0.8 s; 11 GB more GPU"),
              Step(name="z3-cpu-ratio-0.25", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --zero-init --mem-log " + RATIO_SET.format(r=0.25),
                   timeout_s=110, sized="as ratio 0.5, 16 GB more GPU than ratio 1"),
              Step(name="z3-cpu-ratio-0.5-profile", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --zero-init --profile {res}/prof "
                   + RATIO_SET.format(r=0.5), timeout_s=130,
                   sized="ratio 0.5 + synced phases + one profiled step (publish_device_side)"),
              Step(name="z2-cpu-overlap-15-threads", shell="ZEROIO_STEP_THREADS=15 " + LLAMA
                   + " --mode zeroio --config configs/zero2-cpu.json " + OVERLAP,
                   timeout_s=60, sized="32 s measured for the 16-thread run (speed batch)"),
              Step(name="z3-cpu-overlap-15-threads", shell="ZEROIO_STEP_THREADS=15 " + LLAMA
                   + " --mode zeroio --config configs/zero3-cpu.json " + OVERLAP,
                   timeout_s=65, sized="34 s measured for the 16-thread run (speed batch)"),
          )),
    Batch(name="probe13b", kind=Kind.H200,
          what="one 13B try (stage 3, params and optimizer on the CPU, the estimate's ratio, "
               "zero.Init build), 3 steps, memory printed after build / init / every step",
          steps=(
              Step(name="plan-13b", shell=PLAN_13B, timeout_s=30,
                   sized="estimate only; writes the plan's config (its ratio)"),
              Step(name="train-13b", shell=TRAIN_13B, timeout_s=470,
                   sized="zero.Init build of 13B (one module at a time, HF init per module) "
                         "+ partition and pinning ~120 GB host, 3 steps of ~5-20 s; memory "
                         "lines stream to the log, so a kill still shows the last phase"),
          )),
)
Z2 = LLAMA + " --mode zeroio --config configs/zero2-cpu.json " + OVERLAP
Z3 = LLAMA + " --mode zeroio --config configs/zero3-cpu.json " + OVERLAP
"""1.364B z2 / z3 + cpu with the overlapped step (train_llama, 6 steps)."""
DIAG_BATCHES = (
    Batch(name="diag", kind=Kind.H200,
          what="session 3's first call: the GPU tests never run on a GPU (ratio, refactored "
               "stage 3), the host step's parts in isolation (bench_host_step), and z2/z3 + cpu "
               "with the overlapped step printing the worker's host_adam/publish seconds",
          steps=(
              Step(name="ratio-1gpu", shell=_pytest("tests/test_ratio_gpu.py"), timeout_s=80,
                   sized="offload_optimizer.ratio 0.5, 3 cases on 1 GPU (two-GPU test skips)"),
              Step(name="stage3-1gpu", shell=_pytest("tests/test_stage3_gpu.py"), timeout_s=90,
                   sized="stage 3 cases on 1 GPU (40 s on 2 GPUs in session 2)"),
              Step(name="host-step", shell="python3 benchmarks/bench_host_step.py --repeats 2 "
                   "--out {res}", timeout_s=90,
                   sized="fill 4 x 5.5 GB ~15 s + 8 variants x 3 runs x ~0.3 s"),
              Step(name="z2-cpu-overlap", shell=Z2, timeout_s=75,
                   sized="32 s measured in session 2"),
              Step(name="z3-cpu-overlap", shell=Z3, timeout_s=85,
                   sized="34 s measured in session 2"),
          )),
)
DIAG_BATCHES += (
    Batch(name="speed2", kind=Kind.H200,
          what="the one-pass CPU Adam (optim/cpu_adam.py): host step parts, z2/z3 + cpu with "
               "and without the overlapped step, z3 at ratio 0.5, the 13B plan",
          steps=(
              Step(name="host-step", shell="python3 benchmarks/bench_host_step.py --repeats 2 "
                   "--out {res}", timeout_s=100,
                   sized="38 s measured (diag) + inductor compile ~20 s + 2 variants"),
              Step(name="z2-cpu-overlap", shell=Z2, timeout_s=80,
                   sized="42 s measured (diag) + compile"),
              Step(name="z3-cpu-overlap", shell=Z3, timeout_s=85,
                   sized="43 s measured (diag) + compile"),
              Step(name="z2-cpu", shell=LLAMA + " --mode zeroio --config configs/zero2-cpu.json "
                   "--profile {res}/prof", timeout_s=90, sized="session 2 speed batch"),
              Step(name="z3-cpu-ratio-0.5", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --zero-init " + RATIO_SET.format(r=0.5),
                   timeout_s=100, sized="zero.Init build ~40 s + 6 x <= 0.8 s"),
              Step(name="plan-13b", shell="python3 benchmarks/probe_largest.py --plan-only "
                   + PROBE_13B + " --nvme-dir {nvme}/probe | tee {res}/probe-plan-13b.json",
                   timeout_s=30, sized="estimate only"),
          )),
)
DIAG_BATCHES += (
    Batch(name="peers-final", kind=Kind.H200, peers=True,
          what="issue 9's 2x table in one call, ordered by what counts: zeroio z2/z3 + cpu "
               "(overlapped step, one-pass CPU Adam), DeepSpeed z2/z3 + cpu, FSDP2 last",
          steps=(
              Step(name="zeroio-z2-cpu", shell=PEERS6 + " --only zeroio-z2-cpu --timeout 85 "
                   f"{OVERLAP}", timeout_s=90, sized="42 s (diag) + CPU Adam compile ~20 s"),
              Step(name="zeroio-z3-cpu", shell=PEERS6 + " --only zeroio-z3-cpu --timeout 85 "
                   f"{OVERLAP}", timeout_s=90, sized="43 s (diag) + CPU Adam compile ~20 s"),
              _row("ds-z2-cpu", 140, sized="125 s measured with its CPU-Adam JIT (session 3)"),
              _row("ds-z3-cpu", 75, sized="64 s measured (session 3)"),
              _row("fsdp2-cpu", 70, sized="64 s measured (session 3)"),
          )),
)
COMPILED = "ZEROIO_CPU_ADAM=compiled "
WARM_KERNEL = ("ZEROIO_CPU_ADAM=compiled python3 -c \"import time,torch;"
               "from zeroio.optim import cpu_adam;t=time.time();"
               "ok=[cpu_adam.wanted(1, g, o) for g in (torch.float32, torch.bfloat16) "
               "for o in (None, torch.bfloat16)];print('compiled', all(ok), "
               "round(time.time()-t, 1), 's')\"")
"""Compiles every variant a training step may ask for (fp32 or 16-bit host gradients, with or
without the 16-bit output) into the shared inductor cache."""
DS_JIT = ("python3 -c \"import time,torch;t=time.time();from deepspeed.ops.adam import "
          "DeepSpeedCPUAdam;DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))]);"
          "print('DeepSpeed cpu_adam ready', round(time.time()-t, 1), 's')\"")
"""DeepSpeed's CPU-Adam JIT build, the way its optimizer triggers it (into TORCH_EXTENSIONS_DIR)."""
WARM_BOTH = (DS_JIT + " > {logs}/ds-jit.log 2>&1 & ds=$!; " + WARM_KERNEL
             + "; rc=$?; wait $ds; ds_rc=$?; tail -3 {logs}/ds-jit.log; exit $(( rc || ds_rc ))")
"""DeepSpeed's CPU-Adam JIT in the background while zeroio's kernel compiles (nothing timed
meanwhile); fails if either fails."""
AUTO = "ZEROIO_CPU_ADAM=auto "
KERNEL_BATCHES = (
    Batch(name="kernel", kind=Kind.H200,
          what="the one-pass CPU Adam (optim/cpu_adam.py) on the H200 host: compile time "
               "(cache shared by later steps), host step parts, z2/z3 + cpu with the "
               "overlapped step on torch's kernel and on the compiled one",
          steps=(
              Step(name="compile", shell=WARM_KERNEL, timeout_s=90,
                   sized="20 s on the 2-core VM; session 3's first try was still in the ISA "
                         "probe after 40 s (skipped now)"),
              Step(name="cpu-adam-gpu", shell=_pytest("tests/test_cpu_adam_training.py"),
                   timeout_s=60, sized="4 tiny-Llama cases on 1 GPU, kernel cached by 'compile'"),
              Step(name="host-step", shell=COMPILED + "python3 benchmarks/bench_host_step.py "
                   "--repeats 2 --out {res}", timeout_s=60, sized="38 s measured (diag)"),
              Step(name="z2-torch", shell=Z2, timeout_s=70, sized="42 s (diag)"),
              Step(name="z2-compiled", shell=COMPILED + Z2, timeout_s=75, sized="42 s (diag)"),
              Step(name="z3-torch", shell=Z3, timeout_s=70, sized="43 s (diag)"),
              Step(name="z3-compiled", shell=COMPILED + Z3, timeout_s=75, sized="43 s (diag)"),
          )),
    Batch(name="peers-kernel", kind=Kind.H200, peers=True,
          what="issue 9's 2x table in one call with the compiled CPU Adam (compiled first, "
               "cached for the zeroio rows): DeepSpeed z2/z3, zeroio z2/z3, FSDP2",
          steps=(
              Step(name="compile", shell=WARM_KERNEL, timeout_s=55,
                   sized="see the kernel batch"),
              _row("ds-z2-cpu", 140, sized="113-125 s measured with its CPU-Adam JIT (session 3)"),
              _row("ds-z3-cpu", 75, sized="48-64 s measured (session 3)"),
              _row("zeroio-z2-cpu", 75, sized="42 s (diag) + cached kernel", prefix=COMPILED,
                   overlap=True),
              _row("zeroio-z3-cpu", 75, sized="43 s (diag) + cached kernel", prefix=COMPILED,
                   overlap=True),
              _row("fsdp2-cpu", 60, sized="57-64 s measured (session 3); last, expendable"),
          )),
)
KERNEL_BATCHES += (
    Batch(name="verdict", kind=Kind.H200, peers=True,
          what="issue 9's 2x table in one call: DeepSpeed's CPU-Adam JIT built in the background "
               "while zeroio's kernel compiles (nothing timed meanwhile), "
               "then zeroio z2/z3 + cpu (auto: compiled kernel, torch's if it fails), DeepSpeed "
               "z2/z3 + cpu, FSDP2 last",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=75,
                   sized="DeepSpeed JIT 58 s beside zeroio's compile (session 4, first call)"),
              _row("zeroio-z2-cpu", 75, sized="42 s (diag) + cached kernel, no ISA probes",
                   prefix=AUTO, overlap=True),
              _row("zeroio-z3-cpu", 75, sized="43 s (diag) + cached kernel, no ISA probes",
                   prefix=AUTO, overlap=True),
              _row("ds-z2-cpu", 90, sized="113-125 s with its 58 s JIT (session 3); JIT cached"),
              _row("ds-z3-cpu", 75, sized="48-64 s measured (sessions 3, 4)"),
              _row("fsdp2-cpu", 70, sized="57-64 s measured (session 3); last"),
          )),
    Batch(name="probe13b-runahead", kind=Kind.H200,
          what="the 13B try again (session 4's first try ran out of GPU memory in the first "
               "forward): the plan's ratio 0.43 on torch's CPU Adam, then "
               "ratio 0.5 on the one-pass kernel (2-byte host gradients: 11 GB less host, so "
               "7% more of the optimizer fits there and 14 GB less on the GPU)",
          steps=(
              Step(name="plan-13b", shell=PLAN_13B, timeout_s=20, sized="estimate only (4 s)"),
              Step(name="train-13b", shell="ZEROIO_CPU_ADAM=torch " + TRAIN_13B, timeout_s=220,
                   sized="build + init 70 s (session 4), 3 steps of ~5-20 s"),
              Step(name="train-13b-auto-r0.5", shell=AUTO + TRAIN_13B
                   + " --set zero_optimization.offload_optimizer.ratio=0.5", timeout_s=220,
                   sized="as train-13b"),
          )),
    Batch(name="final", kind=Kind.H200, peers=True,
          what="issue 9's stage 2/3 rows again in one call with stage 3's 2-byte host gradients "
               "(one-pass kernel, auto), DeepSpeed z3/z2 beside them; then the GPU test of the "
               "2-byte stage-3 gradients",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=65, sized="59 s (verdict)"),
              _row("zeroio-z3-cpu", 60, sized="39 s (verdict)", prefix=AUTO, overlap=True),
              _row("ds-z3-cpu", 65, sized="45 s (verdict)"),
              _row("zeroio-z2-cpu", 60, sized="43 s (verdict)", prefix=AUTO, overlap=True),
              _row("ds-z2-cpu", 75, sized="61 s (verdict)"),
              Step(name="gpu-tests", shell=_pytest("tests/test_stage3_16bit_grads.py"),
                   timeout_s=60, sized="tiny models; the 2-GPU case skips"),
          )),
    Batch(name="probe13b-linear", kind=Kind.H200,
          what="session 5's first call: stage 3's nn.Linear that keeps the parameter (3114140) "
               "on the GPU (its peak-memory test), then 13B at the plan's ratio under the "
               "default one-pass CPU Adam (session 4: out of memory at 0.43, 24 GiB of saved "
               "weight views), then one try at 44 layers (14.3B)",
          steps=(
              Step(name="stage3-linear", shell=_pytest("tests/test_stage3_linear.py"),
                   timeout_s=40, sized="8 layers of 2048, 2 x 2 steps"),
              Step(name="plan-13b", shell=PLAN_13B, timeout_s=20, sized="estimate only (4 s)"),
              Step(name="train-13b", shell=TRAIN_13B, timeout_s=220,
                   sized="98 s at ratio 0.5 (session 4)"),
              Step(name="probe-44", shell="python3 benchmarks/probe_largest.py "
                   + PROBE_13B.replace("--start-layers 40", "--start-layers 44")
                   + " --nvme-dir {nvme}/probe --max-tries 1 --timeout 210 --out {res}",
                   timeout_s=225, sized="as train-13b, 10% larger"),
          )),
    Batch(name="speed3", kind=Kind.H200, peers=True,
          what="issue 9's stage 2/3 rows beside DeepSpeed with the worker one thread short of "
               "the cores (bench_host_step: 5% faster beside a busy GPU, never measured in "
               "training), and one profiled z3 step (its 0.48-0.82 s spread, session 4)",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="56-59 s (session 4)"),
              _row("zeroio-z2-cpu", 55, sized="38-43 s (session 4)", overlap=True),
              _row("zeroio-z2-cpu", 55, sized="as zeroio-z2-cpu", name="zeroio-z2-cpu-15t",
                   prefix="ZEROIO_STEP_THREADS=15 ", overlap=True),
              _row("zeroio-z3-cpu", 60, sized="39-50 s (session 4)", overlap=True),
              _row("zeroio-z3-cpu", 60, sized="as zeroio-z3-cpu", name="zeroio-z3-cpu-15t",
                   prefix="ZEROIO_STEP_THREADS=15 ", overlap=True),
              _row("ds-z2-cpu", 75, sized="61 s (session 4)"),
              _row("ds-z3-cpu", 58, sized="45-47 s (session 4)", inner=55),
              Step(name="z3-profile", shell=Z3 + " --profile {res}/prof", timeout_s=55,
                   sized="43 s (diag) + one profiled step"),
          )),
    Batch(name="assist", kind=Kind.H200, peers=True,
          what="session 5: the GPU's share of the host step (optim/assist.py, on by default): "
               "its GPU tests, then issue 9's stage 2/3 rows with it, stage 2 without it, and "
               "DeepSpeed's, in one call",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="56-59 s (session 4)"),
              Step(name="assist-tests", shell=_pytest("tests/test_step_assist.py"),
                   timeout_s=100, sized="3 cases x 3 engines, tiny MLP (unmeasured)"),
              _row("zeroio-z2-cpu", 55, sized="38-43 s (session 4)", overlap=True),
              _row("zeroio-z2-cpu", 55, sized="as zeroio-z2-cpu", name="zeroio-z2-cpu-noassist",
                   prefix="ZEROIO_STEP_ASSIST=0 ", overlap=True),
              _row("zeroio-z3-cpu", 60, sized="39-50 s (session 4)", overlap=True),
              _row("ds-z2-cpu", 75, sized="61 s (session 4)"),
              _row("ds-z3-cpu", 58, sized="45-47 s (session 4)", inner=55),
          )),
    Batch(name="final5", kind=Kind.H200, peers=True,
          what="session 5's table: the step assist's GPU tests (foreach copies, stage 3 fetch "
               "ordered on the GPU), then zeroio z2/z3 + cpu with it beside DeepSpeed z2/z3 and "
               "FSDP2 in one call",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="57 s (assist call)"),
              Step(name="assist-tests", shell=_pytest("tests/test_step_assist.py"),
                   timeout_s=90, sized="57 s (assist call)"),
              _row("zeroio-z2-cpu", 65, sized="49 s (assist call)", overlap=True),
              _row("zeroio-z3-cpu", 60, sized="45 s (assist call)", overlap=True),
              _row("ds-z2-cpu", 72, sized="62 s (assist call)"),
              _row("ds-z3-cpu", 58, sized="46 s (assist call)", inner=55),
              _row("fsdp2-cpu", 70, sized="48 s (session 4, call 2)"),
          )),
    Batch(name="probe13b-assist", kind=Kind.H200,
          what="session 5: 13B at the plan's ratio with the step assist on (the default; the "
               "plan counts its slots), and stage 3's 2-byte host gradient tests on the GPU",
          steps=(
              Step(name="plan-13b", shell=PLAN_13B, timeout_s=20, sized="estimate only (4 s)"),
              Step(name="train-13b", shell=TRAIN_13B, timeout_s=170,
                   sized="100 s without the assist (session 5, call 1)"),
              STAGE3_16BIT,
          )),
    Batch(name="stage3-16bit", kind=Kind.H200,
          what="stage 3's 2-byte host gradient GPU tests alone",
          steps=(
              STAGE3_16BIT,
          )),
    Batch(name="gpu2-assist", kind=Kind.H200_X2,
          what="the step assist on 2 GPUs (NCCL): stage 2 fp32/bf16 and stage 3 bf16 against "
               "the reference (passed in 71 s, session 6 call 1: \"auto\" now at any world)",
          steps=(
              Step(name="assist-nccl", shell=_pytest(" ".join(
                  f"'tests/test_step_assist.py::test_step_assist_matches_reference[2-{c}]'"
                  for c in ("2-fp32", "2-bf16", "3-bf16"))),
                  timeout_s=150, sized="57 s for the three cases on 1 GPU (session 5)"),
          )),
    Batch(name="peers-x2", kind=Kind.H200_X2, peers=True,
          what="session 6's call 2 (a record): zeroio z2/z3 + cpu, DeepSpeed z2/z3, FSDP2 at "
               "2 ranks, under torchrun's OMP_NUM_THREADS=1 (host Adam on one thread, "
               "zeroio's and DeepSpeed's); DeepSpeed z3 and FSDP2 failed in their runners",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="57 s (session 5)"),
              _row("zeroio-z2-cpu", 65, sized="49 s on 1 GPU (session 5)", overlap=True,
                   extra="--nproc 2"),
              _row("zeroio-z2-cpu", 65, sized="as zeroio-z2-cpu", name="zeroio-z2-cpu-assist",
                   overlap=True,
                   extra="--nproc 2 --set zero_optimization.tiering.step_assist=true"),
              _row("zeroio-z3-cpu", 65, sized="49 s on 1 GPU (session 5)", overlap=True,
                   extra="--nproc 2 --set zero_optimization.tiering.step_assist=true"),
              _row("ds-z2-cpu", 78, sized="68 s on 1 GPU (session 5)", extra="--nproc 2"),
              _row("ds-z3-cpu", 70, sized="56 s on 1 GPU (session 5)", inner=65,
                   extra="--nproc 2"),
              _row("fsdp2-cpu", 75, sized="61 s on 1 GPU (session 5)", extra="--nproc 2"),
          )),
    Batch(name="peers-x2b", kind=Kind.H200_X2, peers=True,
          what="issue 9's --nproc 2 table on 2 GPUs: zeroio z2 + cpu with the step assist "
               "(\"auto\") and without, z3 + cpu, DeepSpeed z2/z3, FSDP2; every rank gets "
               "OMP_NUM_THREADS = CPUs / 2 (train_peers), the runners' 2-rank fixes",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="60 s (session 6 call 2)"),
              _row("zeroio-z2-cpu", 60, sized="54 s at 2 ranks (session 6 call 2)",
                   overlap=True, extra="--nproc 2"),
              _row("zeroio-z2-cpu", 60, sized="as zeroio-z2-cpu", name="zeroio-z2-cpu-no-assist",
                   overlap=True,
                   extra="--nproc 2 --set zero_optimization.tiering.step_assist=false"),
              _row("zeroio-z3-cpu", 60, sized="55 s at 2 ranks (session 6 call 2)",
                   overlap=True, extra="--nproc 2"),
              _row("ds-z2-cpu", 78, sized="74 s at 2 ranks, Adam on one thread (session 6)",
                   extra="--nproc 2"),
              _row("ds-z3-cpu", 75, sized="56 s on 1 GPU (session 5)", extra="--nproc 2"),
              _row("fsdp2-cpu", 75, sized="61 s on 1 GPU (session 5)", extra="--nproc 2"),
          )),
    Batch(name="check6", kind=Kind.H200, peers=True,
          what="gpu1-tests-b (the step assist's out-of-memory fallback never ran) and 1-GPU "
               "zeroio z2/z3 + cpu beside DeepSpeed z2: the host step's new thread default "
               "at one rank",
          steps=(
              Step(name="warm", shell=WARM_BOTH, timeout_s=62, sized="50-60 s (session 6)"),
              *GPU1_B,
              _row("zeroio-z2-cpu", 55, sized="42 s (session 6, call 4)", overlap=True),
              _row("zeroio-z3-cpu", 55, sized="44 s (session 6, call 4)", overlap=True),
              _row("ds-z2-cpu", 72, sized="66 s (session 6, call 4)"),
          )),
    Batch(name="assist-oom", kind=Kind.H200,
          what="the step assist's GPU tests again, the out-of-memory fallback included (check6 "
               "lost its result to the test harness: the rank exited before its tensors "
               "were fetched)",
          steps=GPU1_B[2:]),
    Batch(name="prof-x2", kind=Kind.H200_X2,
          what="where zeroio z2 + cpu's step goes at 2 ranks (1.95x DeepSpeed in peers-x2b): "
               "synced phases and one profiled step (rank 0's trace, gzipped)",
          steps=(
              Step(name="z2-x2-profile", shell="OMP_NUM_THREADS=16 python3 -m "
                   "torch.distributed.run --standalone --nproc_per_node=2 "
                   + Z2.removeprefix("python3 ") + " --profile {res}/prof; rc=$?; "
                   "gzip -f {res}/prof/trace-*.json; exit $rc", timeout_s=170,
                   sized="54 s for 6 steps (peers-x2b) + 2 synced steps + the profiler"),
          )),
    Batch(name="ratio12", kind=Kind.H200,
          what="offload_optimizer.ratio at stage 2 (zeroio extension): 1.364B z2 + cpu with the "
               "overlapped step at ratio 1, 0.5, 0.25 on torch's CPU Adam, ratio 0.5 on the "
               "compiled one, and z3 at ratio 0.5 for comparison",
          steps=(
              Step(name="compile", shell=WARM_KERNEL, timeout_s=90, sized="see the kernel batch"),
              Step(name="z2-r1", shell=Z2, timeout_s=70, sized="42 s (diag)"),
              Step(name="z2-r0.5", shell=Z2 + " --set zero_optimization.offload_optimizer."
                   "ratio=0.5", timeout_s=70, sized="as z2-r1, 11 GB more GPU"),
              Step(name="z2-r0.25", shell=Z2 + " --set zero_optimization.offload_optimizer."
                   "ratio=0.25", timeout_s=70, sized="as z2-r1, 16 GB more GPU"),
              Step(name="z2-r0.5-compiled", shell=COMPILED + Z2 + " --set zero_optimization."
                   "offload_optimizer.ratio=0.5", timeout_s=75, sized="kernel cached"),
              Step(name="z3-r0.5", shell=LLAMA + " --mode zeroio --config "
                   "configs/zero3-cpu.json --zero-init " + RATIO_SET.format(r=0.5),
                   timeout_s=100, sized="86 s with the single-threaded kernel (speed2)"),
          )),
)
BATCHES = BATCHES + RATIO_BATCHES + DIAG_BATCHES + KERNEL_BATCHES
BY_NAME = {b.name: b for b in BATCHES}


def run_command(batch: Batch, commit: str, extra: str = "") -> str:
    """The `run` tool's command string for ``batch``."""
    cmd = f"ZEROIO_COMMIT={commit} python3 tools/device_batch.py {batch.name} --out $OUT"
    return cmd + (f" {extra}" if extra else "")


def run_params(batch: Batch, commit: str, extra: str = "") -> dict:
    return {"command": run_command(batch, commit, extra), "carry": batch.carry,
            "kind": batch.kind.value, "timeout_s": RUN_TIMEOUT_S}


def local_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def expand(step: Step, res: Path, nvme: Path, logs: Path, probe_layers: int | None) -> str:
    return step.shell.format(res=res, nvme=nvme, logs=logs, step=step.name,
                             probe_layers=f" --start-layers {probe_layers}" if probe_layers else "")


# -- on the device ---------------------------------------------------------------------------

SETUP = """set -e
rm -rf /tmp/site && mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
"""
SETUP_PEERS = """python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/*.whl
mkdir -p /tmp/libaio && for d in .peers/libaio*.deb; do dpkg -x "$d" /tmp/libaio; done
"""
CHECK = ("python3 -c \"import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,"
         "'gpus',torch.cuda.device_count());[print(m,'missing') for m in "
         "('pytest','hypothesis','zarr','psutil','tqdm','aiofiles','deepspeed') "
         "if __import__('importlib').util.find_spec(m) is None]\"")


def device_env(commit: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(["/tmp/site", str(REPO), str(REPO / "tests")])
    env["ZEROIO_COMMIT"] = commit
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    # build/ is git-ignored, so DeepSpeed's JIT ops survive between calls on a warm machine
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    # inductor's cache (zeroio's compiled CPU Adam) shared by the batch's steps, as above
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "build" / "inductor"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclasses.dataclass(kw_only=True)
class StepResult:
    name: str
    status: str
    """ok | failed | timeout | skipped"""
    wall_s: float
    timeout_s: int
    note: str = ""


def run_step(name: str, shell: str, timeout: float, env: dict[str, str], log: Path) -> StepResult:
    """Run ``shell`` in its own process group; tee its output to the console and ``log``."""
    t0 = time.perf_counter()
    if timeout <= 0:
        return StepResult(name=name, status="skipped", wall_s=0.0, timeout_s=0,
                          note="no batch time left")
    print(f"\n=== {name} (timeout {timeout:.0f} s): {shell}", flush=True)
    with open(log, "wb") as f:
        f.write(f"$ {shell}\n".encode())
        proc = subprocess.Popen(["bash", "-c", "set -o pipefail; " + shell], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        deadline = t0 + timeout
        timed_out = False
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            chunk = proc.stdout.read(65536)
            if chunk:
                f.write(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            elif proc.poll() is not None:
                break
            else:
                time.sleep(0.2)
            if time.perf_counter() > deadline and proc.poll() is None:
                timed_out = True
                kill_group(proc)
        rest = proc.stdout.read() or b""
        f.write(rest)
        sys.stdout.write(rest.decode(errors="replace"))
    wall = time.perf_counter() - t0
    if timed_out:
        status, note = "timeout", f"killed after {timeout:.0f} s"
    elif proc.returncode == 0:
        status, note = "ok", ""
    else:
        status, note = "failed", f"exit code {proc.returncode}: {_last_error(log)}"
    print(f"=== {name}: {status} in {wall:.0f} s {note}", flush=True)
    return StepResult(name=name, status=status, wall_s=wall, timeout_s=int(timeout), note=note)


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "FAILED" in ln or "error:" in ln]
    return ((errs or lines or [""])[-1])[:200]


def result_lines(res: Path) -> list[str]:
    """One line per result row found in the results folder (train_peers, bench_train, probe)."""
    lines = []
    for path in sorted(res.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict):
            continue
        if doc.get("kind") == "train_peers":
            for r in doc.get("rows", []):
                s = r.get("s_per_step")
                tps = r.get("tokens_per_s")
                lines.append(f"{r['name']} x{r.get('world', 1)}: {r['status']}"
                             + (f" {s:.3f} s/step {tps:,.0f} tok/s" if s and tps else "")
                             + (f" peak GPU {r['peak_gpu_gib']:.1f} GiB" if r.get("peak_gpu_gib") else "")
                             + (f" host {r['peak_host_rss_gib']:.1f} GiB" if r.get("peak_host_rss_gib") else "")
                             + (f" ({r['reason'][:160]})" if r.get("reason") else ""))
            bound = doc.get("disk_bound_s_per_step") or {}
            raw = ((doc.get("disk") or {}).get("raw") or {})
            if raw:
                lines.append(f"disk raw write {raw.get('write_gbps')} / read {raw.get('read_gbps')} GB/s"
                             + "".join(f"; {k} disk-bound {v:.2f} s/step" for k, v in bound.items()))
        elif doc.get("benchmark") == "zeroio train":
            for r in doc.get("runs", []):
                if r.get("ok"):
                    steps = r.get("step_seconds") or []
                    med = sorted(steps[2:])[len(steps[2:]) // 2] if len(steps) > 2 else None
                    lines.append(f"zeroio train {doc['preset']} x{r['nproc']}: ok "
                                 f"{r.get('steady_tokens_per_s') or 0:,.0f} steady tok/s"
                                 + (f", median {med:.2f} s/step" if med else "")
                                 + f", loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
                else:
                    lines.append(f"zeroio train {doc['preset']} x{r['nproc']}: {r.get('error')}")
        elif doc.get("kind") == "probe_largest":
            for t in doc.get("tries", []):
                lines.append(f"probe {t['layers']} layers ({t['params'] / 1e9:.2f} B): "
                             f"{t['status']} {t.get('reason') or ''} s/step {t.get('s_per_step')}")
    return lines


def summary(batch: Batch, commit: str, results: list[StepResult], res: Path) -> str:
    out = [f"# {batch.name} (commit {commit})", "", "| step | status | wall s | timeout s | note |",
           "|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r.name} | {r.status} | {r.wall_s:.0f} | {r.timeout_s} | "
                   f"{r.note.replace('|', '/')} |")
    rows = result_lines(res)
    if rows:
        out += ["", *[f"- {ln}" for ln in rows]]
    return "\n".join(out) + "\n"


def pack(stage: Path, out: Path, batch: Batch, text: str) -> Path:
    """Cap big logs, then write ``<batch>.tar.gz`` and ``<batch>-summary.md`` into ``out``."""
    for p in stage.rglob("*"):
        if p.is_file() and p.stat().st_size > LOG_CAP_BYTES and p.suffix in (".log", ".err", ".out"):
            with open(p, "rb") as f:
                f.seek(-LOG_CAP_BYTES, os.SEEK_END)
                tail = f.read()
            p.write_bytes(b"[cut to the last bytes]\n" + tail)
    (stage / "summary.md").write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{batch.name}.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(stage, arcname=batch.name)
    final = out / f"{batch.name}.tar.gz"
    tmp.replace(final)
    (out / f"{batch.name}-summary.md").write_text(text)
    return final


def setup_shell(batch: Batch) -> str:
    return SETUP + (SETUP_PEERS if batch.peers else "") + CHECK + "\nnvidia-smi -L || true\n"


def run_batch(batch: Batch, out: Path, commit: str, probe_layers: int | None,
              stage_root: Path = STAGE, nvme_root: Path = NVME, setup: str | None = None,
              budget_s: float = BATCH_BUDGET_S) -> int:
    """Run ``batch`` (``setup`` replaces the wheel install, for tests) and pack after each step."""
    t_start = time.perf_counter()
    stage = stage_root / batch.name
    res, logs, nvme = stage / "results", stage / "logs", nvme_root / batch.name
    for d in (res, logs, nvme):
        d.mkdir(parents=True, exist_ok=True)
    env = device_env(commit)
    (stage / "provenance.json").write_text(json.dumps(
        {"batch": batch.name, "commit": commit, "kind": batch.kind.value,
         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    setup = setup_shell(batch) if setup is None else setup
    results = [run_step("setup", setup, batch.setup_s, env, logs / "setup.log")]
    pack(stage, out, batch, summary(batch, commit, results, res))
    if results[0].status == "ok":
        for step in batch.steps:
            left = budget_s - (time.perf_counter() - t_start)
            shell = expand(step, res, nvme, logs, probe_layers)
            results.append(run_step(step.name, shell, min(step.timeout_s, left), env,
                                    logs / f"{step.name}.log"))
            text = summary(batch, commit, results, res)
            pack(stage, out, batch, text)
    text = summary(batch, commit, results, res)
    pack(stage, out, batch, text)
    print("\n" + text, flush=True)
    return 0 if all(r.status == "ok" for r in results) else 1


def describe(batch: Batch, commit: str, probe_layers: int | None = None) -> str:
    res, nvme = STAGE / batch.name / "results", NVME / batch.name
    lines = [f"{batch.name} ({batch.kind.value}, carry {batch.carry}): {batch.what}",
             f"  setup ({'wheels + .peers + libaio' if batch.peers else 'wheels'}): "
             f"timeout {batch.setup_s} s"]
    for s in batch.steps:
        lines.append(f"  {s.name}: timeout {s.timeout_s} s ({s.sized})\n"
                     f"    $ {expand(s, res, nvme, STAGE / batch.name / 'logs', probe_layers)}")
    lines.append(f"  total {batch.total_s} s of {BATCH_BUDGET_S} s budget")
    extra = f"--probe-layers {probe_layers}" if probe_layers else ""
    lines.append("  run: " + json.dumps(run_params(batch, commit, extra)))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", nargs="?", choices=sorted(BY_NAME))
    ap.add_argument("--out", type=Path, help="where the tarball and summary go ($OUT)")
    ap.add_argument("--list", action="store_true", help="every batch, its steps and timeouts")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--print-run", action="store_true",
                    help="print the `run` tool parameters (JSON) with this checkout's commit")
    ap.add_argument("--probe-layers", type=int, help="depth for the probe batch (default: estimate)")
    args = ap.parse_args(argv)
    commit = os.environ.get("ZEROIO_COMMIT") or local_commit()
    if args.list:
        print("\n\n".join(describe(b, commit) for b in BATCHES))
        return 0
    if args.batch is None:
        ap.error("name a batch (or --list)")
    batch = BY_NAME[args.batch]
    extra = f"--probe-layers {args.probe_layers}" if args.probe_layers else ""
    if args.print_run:
        print(json.dumps(run_params(batch, commit, extra)))
        return 0
    if args.dry_run:
        print(describe(batch, commit, args.probe_layers))
        return 0
    if args.out is None:
        ap.error("--out is required to run a batch (on the device: --out $OUT)")
    return run_batch(batch, args.out, commit, args.probe_layers)


if __name__ == "__main__":
    sys.exit(main())
