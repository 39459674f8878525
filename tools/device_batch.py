"""Named GPU suites for the device tool: set up, run each step under a deadline, pack into $OUT.

    python tools/device_batch.py --list                      # every suite and its steps
    python tools/device_batch.py peers --dry-run             # the expanded commands, run nothing
    python tools/device_batch.py peers --print-run           # the `run` tool's parameters (JSON)
    # on the device machine (it has no .git: the commit comes from here)
    ZEROIO_COMMIT=<sha> python3 tools/device_batch.py peers --out $OUT

Every step runs in its own process group under its own deadline, its output
streams to the console and to ``logs/<step>.log``; after every step the staging
folder is packed again into ``$OUT/<suite>.tar.gz`` with ``$OUT/<suite>-summary.md``
beside it, so a call cut off at its limit still brings back what finished. The
limits (``--budget-s``, the command length, the carried paths) are the device
tool's, passed in as parameters; nothing here is a property of zeroio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from procs import kill_group  # noqa: E402  (benchmarks/procs.py, standard library only)

REPO = Path(__file__).resolve().parent.parent
CALL_LIMIT_S = 600
"""The device tool's limit for one command."""
BUDGET_S = 540
"""Setup and steps together; the rest of CALL_LIMIT_S is left for packing and the transfer."""
MAX_COMMAND_CHARS = 2000
MAX_CARRY = 8
QUOTED = 8
LOG_CAP_BYTES = 2 << 20
"""Logs above this are cut to their last LOG_CAP_BYTES before packing."""
STAGE = Path("/tmp/zeroio-batch")
SCRATCH = Path("/tmp/zeroio-batch-nvme")
"""Swap folders and run outputs on the machine's disk (not under STAGE: never packed)."""


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    shell: str
    """bash; {res} = results (packed), {scratch} = scratch (not packed), {logs}, {extra}."""
    timeout_s: int
    quote: str = ""
    """Regex: the step's last QUOTED log lines that match it go into the summary."""


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    kind: str
    what: str
    steps: tuple[Step, ...]
    peers: bool = False
    """Install DeepSpeed and its wheels from .peers/ and unpack libaio (carry .peers)."""
    extra_carry: tuple[str, ...] = ()
    """Other git-ignored paths the steps need (e.g. the baseline checkout)."""

    setup_s = property(lambda self: 60 if self.peers else 30)
    carry = property(lambda self: [".whl"] + ([".peers"] if self.peers else [])
                     + list(self.extra_carry))


GPU_MARK = re.compile(r"^(\s*@pytest\.mark\.gpu\b|pytestmark = .*pytest\.mark\.gpu)"
                      r"|pytest\.param\(.*marks=pytest\.mark\.gpu\b", re.M)
"""A decorated test, a module-wide mark, or a parameter marked gpu (``pytest.param(...)``)."""


def gpu_test_files(root: Path = REPO) -> list[Path]:
    """Test files with ``-m gpu`` tests (a decorated test or a module-wide ``pytestmark``)."""
    return sorted(p for p in (root / "tests").glob("test_*.py") if GPU_MARK.search(p.read_text()))


def _pytest_steps(timeout_s: int) -> tuple[Step, ...]:
    return tuple(Step(p.stem.removeprefix("test_"), "python3 -m pytest -q -m gpu -p no:cacheprovider "
                      f"--junitxml {{res}}/junit-{p.stem}.xml tests/{p.name}", timeout_s)
                 for p in gpu_test_files())


PEER_ROWS: tuple[tuple[str, int, int], ...] = (
    # (contender, step timeout s, training steps); DeepSpeed's JIT ops are built by ds-jit first;
    # the rows of the table's headline comparison first, so a call's budget cuts the extra modes
    ("zeroio-z2-cpu", 75, 6), ("zeroio-z3-cpu", 75, 6), ("ds-z2-cpu", 75, 6),
    ("ds-z3-cpu", 70, 6), ("zeroio-z2-cpu-streamed", 75, 6), ("zeroio-z3-cpu-streamed", 75, 6),
    # ZenFlow's figure is the mean over whole update windows after its first update
    # (update_interval 4): 12 steps give two whole windows
    ("ds-z2-zenflow", 140, 12), ("fsdp2-cpu", 75, 6), ("plain", 45, 6),
    ("ds-z3-twinflow", 80, 6), ("ds-z3-superoffload", 85, 6), ("ds-z3-zenflow", 60, 12),
    ("torchao-cpu", 120, 6),
)
"""One step each, in this order; a call's budget cuts the tail (run it with --only next)."""


SHAPE_4B = "--hidden 4096 --layers 20 --intermediate 11008 --heads 32"
"""The widest shape DeepSpeed ZeRO-3 + CPU offload trains on one H200 (4.31B, micro batch 8)."""

WIDE_ROWS: tuple[tuple[str, int, int], ...] = (
    ("zeroio-z3-cpu", 130, 6), ("ds-z3-cpu", 190, 6), ("zeroio-z2-cpu", 110, 6),
    ("ds-z2-cpu", 150, 6),
)
"""The peers rows at SHAPE_4B, stage 3 first (the comparison that shape is for)."""


def _peers_steps(nproc: int, rows: tuple[tuple[str, int, int], ...] = PEER_ROWS,
                 shape: str = "") -> tuple[Step, ...]:
    """benchmarks/train_peers.py, one contender per step (the 1.364B default shape unless
    ``shape`` names another); each row's own --timeout sits 5 s inside the step's so the
    script writes its failure row."""
    run = ("python3 benchmarks/train_peers.py --warmup 2 --quiet --nvme-dir {scratch} "
           f"--out {{res}} --nproc {nproc}" + (f" {shape}" if shape else ""))
    jit = ("python3 -c \"import time,torch;t=time.time();from deepspeed.ops.adam import "
           "DeepSpeedCPUAdam;DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))]);"
           "print('DeepSpeed cpu_adam ready', round(time.time()-t, 1), 's')\"")
    return (Step("ds-jit", jit, 70),) + tuple(
        Step(name, f"{run} --steps {steps} --only {name} --timeout {t - 5}"
             + (" --libaio-dir /tmp/libaio" if name.startswith("ds-") else "") + "{extra}", t,
             quote=r"^\| (?!contender|-)")
        for name, t, steps in rows)


BEFORE = ".old"
"""A checkout of the baseline commit's ``zeroio/`` and ``benchmarks/`` (git-ignored; make it with
``git archive <commit> zeroio benchmarks | tar -x -C .old``), carried by the before-after suite."""


def _before_after_steps() -> tuple[Step, ...]:
    """zeroio z2 and z3 + CPU offload at the baseline (``.old``) and at this tree, interleaved
    (before z2, after z2, before z3, after z3) so a drift of the host hits both sides."""
    run = ("python3 benchmarks/train_peers.py --steps 7 --warmup 2 --quiet --disk-bench-size 0 "
           "--nvme-dir {scratch} --timeout 80")
    out = []
    for row in ("zeroio-z2-cpu", "zeroio-z3-cpu"):
        out.append(Step(f"before-{row}", f"cd {BEFORE} && PYTHONPATH=/tmp/site:$PWD {run} --only "
                        f"{row} --out {{res}}/before{{extra}}", 85, quote=r"^\| (?!contender|-)"))
        out.append(Step(f"after-{row}", f"{run} --only {row} --out {{res}}/after{{extra}}", 85,
                        quote=r"^\| (?!contender|-)"))
    return tuple(out)


LEVERS: tuple[tuple[str, str, str], ...] = (
    # (step name, contender, environment overrides): defaults first, then one lever each
    ("z2-default", "zeroio-z2-cpu", ""), ("z2-overlap", "zeroio-z2-cpu", "ZEROIO_OVERLAP_STEP=1"),
    ("z2-overlap-noassist", "zeroio-z2-cpu", "ZEROIO_OVERLAP_STEP=1 ZEROIO_STEP_ASSIST=0"),
    ("z3-default", "zeroio-z3-cpu", ""), ("z3-overlap", "zeroio-z3-cpu", "ZEROIO_OVERLAP_STEP=1"),
)
"""zeroio's CPU-offload rows under one environment switch each (config/overrides.py)."""


def _levers_steps() -> tuple[Step, ...]:
    run = ("python3 benchmarks/train_peers.py --steps 7 --warmup 2 --quiet --disk-bench-size 0 "
           "--nvme-dir {scratch} --timeout 80")
    tests = Step("cpu_adam_training", "python3 -m pytest -q -m gpu -p no:cacheprovider "
                 "--junitxml {res}/junit-cpu_adam_training.xml tests/test_cpu_adam_training.py", 120)
    return (tests,) + tuple(
        Step(name, f"{env} {run} --only {row} --out {{res}}/{name}{{extra}}".strip(), 85,
             quote=r"^\| (?!contender|-)") for name, row, env in LEVERS)


SHAPE_15B = ("--hidden 5120 --intermediate 13824 --heads 40 --vocab 32000")
"""The 15.24B Llama of the NVMe regime (47 layers)."""


def _nvme_steps(accumulation: int, steps: int, timeout_s: int) -> tuple[Step, ...]:
    """The disk's best (fio's sweep, `zeroio bench io`), the 15B plan, then the 15B run."""
    train = ("python3 benchmarks/train_llama.py --mode zeroio --config {res}/cfg-15b.json "
             f"--zero-init --mem-log {SHAPE_15B} --layers 47 --seq 1024 --micro-batch 1 "
             f"--accumulation {accumulation} --steps {steps} --warmup 1 "
             "--nvme-path {scratch}/nvme --out {res} --quiet{extra}")
    return (
        Step("pfm-gpu", "python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml "
             "{res}/junit-pfm.xml tests/test_params_from_master_gpu.py", 120,
             quote=r"passed|failed|Error"),
        Step("disk", "df -B1 . /tmp; free -b; nproc; rm -rf {scratch}/disk && mkdir -p "
             "{scratch}/disk && python3 -m zeroio.cli bench io --path {scratch}/disk --size 2G "
             "--fio .dev/fio --sustained 16G --json > {res}/bench-io.json && python3 -c \"import "
             "json;r=json.load(open('{res}/bench-io.json'));print('raw',r['raw']['write_gbps'],"
             "r['raw']['read_gbps'],'mixed',r['raw']['mixed'],'sustained',r['raw']['sustained'],"
             "'engine',r['engine'])\"", 200,
             quote="."),
        Step("plan", f"python3 benchmarks/probe_largest.py --plan-only {SHAPE_15B} "
             "--start-layers 47 --gpu-gib 139 --ram-gib 125 --disk-gib 64 --write-config "
             "{res}/cfg-15b.json | tail -c 600", 60, quote="."),
        Step("train-15b", train, timeout_s, quote=r"step \d|engine|built|Error|error"),
    )


def _accum_steps() -> tuple[Step, ...]:
    disk, plan, train = _nvme_steps(16, 2, 400)[1:]
    bench = Step("nvme-step", "rm -rf {scratch}/step && mkdir -p {scratch}/step && python3 "
                 "benchmarks/bench_nvme_step.py --path {scratch}/step --elements 1e9 --budget "
                 "1e9 --threads 1,4 --read-ahead 3,8 --steps 1 --disk {res}/bench-io.json "
                 "--out {res} && rm -rf {scratch}/step", 150, quote="best")
    best = ("B=$(python3 -c \"import json,glob;r=json.load(open(sorted(glob.glob('{res}/nvme-"
            "step-*.json'))[-1]))['best'];print(r['threads'],r['read_ahead'])\" || echo 1 3); "
            "set -- $B; echo \"best: threads $1 read ahead $2\"; ")
    tuned = (" --set aio.intra_op_parallelism=$1 --set zero_optimization.tiering.prefetch_depth=$2")
    return (disk, bench, plan, Step("train-15b-accum", best + train.shell.replace(
        "{extra}", tuned + "{extra}"), train.timeout_s, quote=train.quote))


def _train_planned(size: str, seq: int, timeout_s: int, accumulation: int = 1) -> Step:
    """`zeroio train` on benchmarks/models/llama-<size>: its plan, 3 steps at micro batch 1
    (``accumulation`` micro-steps each) and the bf16 model export, under benchmarks/peaks.py
    (peaks sampled every second)."""
    run = "{scratch}/run" + size
    accum = f" --grad-accum {accumulation}" if accumulation > 1 else ""
    return Step("train", f"df -B1 {{scratch}}; free -b; nproc; rm -rf {run} && python3 "
                f"benchmarks/peaks.py --path {{scratch}} --every 1 --json {{res}}/peaks-{size}.json "
                f"-- python3 -m zeroio.cli train --model-config benchmarks/models/llama-{size} "
                f"--nproc 1 --steps 3 --seq-len {seq} --micro-batch 1{accum} --no-checkpoint "
                f"--model-dtype bf16 --output {run} --progress-every 1{{extra}}; rc=$?; cp "
                f"{run}/zeroio-plan.json {{res}}/ 2>/dev/null; ls -la {run}/model; du -sb "
                f"{run}/model; rm -rf {run}; exit $rc", timeout_s,
                quote=r"step \d|plan|predicted|measured|peaks|Error|error|GB")


SHAPE_8B = ("--hidden 4096 --layers 32 --intermediate 14336 --heads 32 --kv-heads 8 "
            "--vocab 128256 --seq 2048")
"""Llama-3-8B's shape (8.03B) at seq 2048: the large-batch comparison with MegaTrain."""


def _zeroio_8b(name: str, accumulation: int, steps: int, timeout_s: int) -> Step:
    """zeroio stage 3 + CPU offload (configs/zero3-cpu.json as is), the 8B built inside
    zero.Init, activation checkpointing, micro batch 8 x ``accumulation``."""
    return Step(name, f"python3 benchmarks/train_llama.py --mode zeroio --config "
                f"configs/zero3-cpu.json --zero-init --grad-ckpt --mem-log {SHAPE_8B} "
                f"--micro-batch 8 --accumulation {accumulation} --steps {steps} --warmup 1 "
                f"--quiet --out {{res}}/zeroio-mb8-ga{accumulation}{{extra}}", timeout_s,
                quote=r"zeroio:|step \d|Error|error|Capacity")


def _megatrain_8b(micro_batch: int, steps: int, timeout_s: int) -> Step:
    """MegaTrain (.peers/megatrain: its infinity/ package, fetched separately) on the same
    8B shape at ``micro_batch`` (benchmarks/peers/megatrain_runner.py)."""
    return Step(f"megatrain-mb{micro_batch}", "python3 benchmarks/peers/megatrain_runner.py "
                f"--megatrain-dir .peers/megatrain {SHAPE_8B} --micro-batch {micro_batch} "
                f"--steps {steps} --warmup 1 --out {{res}}{{extra}}", timeout_s,
                quote=r"megatrain:|built|step \d|Error|error")


def _large_batch_steps(part: str) -> tuple[Step, ...]:
    """The 8B beside MegaTrain: part "peer" (DeepSpeed's CPU Adam built, a MegaTrain smoke
    run on a small shape, MegaTrain at its micro batch 64), part "zeroio" (micro batch 8 x 1,
    then x 8: 131k tokens a step, MegaTrain's regime)."""
    if part == "peer":
        jit = ("python3 -c \"import time,torch;t=time.time();from deepspeed.ops.adam import "
               "DeepSpeedCPUAdam;DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))]);"
               "print('DeepSpeed cpu_adam ready', round(time.time()-t, 1), 's')\"")
        smoke = Step("megatrain-smoke", "python3 benchmarks/peers/megatrain_runner.py "
                     "--megatrain-dir .peers/megatrain --hidden 256 --layers 4 --intermediate "
                     "512 --heads 4 --kv-heads 2 --vocab 1024 --seq 256 --micro-batch 2 "
                     "--steps 2 --warmup 1 --out {res}/smoke", 90, quote=r"megatrain:|Error")
        return (Step("ds-jit", jit, 80), smoke, _megatrain_8b(64, 3, 310))
    return (_zeroio_8b("zeroio-mb8", 1, 5, 220), _zeroio_8b("zeroio-mb8-ga8", 8, 3, 300))


def _large_batch_pair_steps() -> tuple[Step, ...]:
    """zeroio's accumulation row and MegaTrain's best row in one call, so the comparison is on
    one card: zeroio first (the row the target is about), then DeepSpeed's CPU Adam for
    MegaTrain, then MegaTrain at micro batch 64."""
    peer = _large_batch_steps("peer")
    return (_zeroio_8b("zeroio-mb8-ga8", 8, 3, 230), Step("ds-jit", peer[0].shell, 70),
            _megatrain_8b(64, 3, 180))


def _growing_steps() -> tuple[Step, ...]:
    """benchmarks/growing_batch.py at SHAPE_4B, micro batch 8: 3 steps at seq 1024 then 2 at
    4096, stages 2 and 3 with the defaults ("auto" resident chunks) beside gpu_budget_bytes 0,
    then the GPU test of the yield ([Note: resident state yields] in zeroio/tiering/gpu_tier.py)."""
    run = (f"python3 benchmarks/growing_batch.py {SHAPE_4B} --micro-batch 8 "
           "--seqs 1024,1024,1024,4096,4096 --out {res}")
    rows = tuple(Step(f"z{stage}-{budget}", f"{run} --config configs/zero{stage}-cpu.json "
                      f"--budget {budget}{{extra}}", 105, quote=r"^step \d|OOM|Error")
                 for budget in ("auto", "0") for stage in (2, 3))
    test = Step("gpu_tier", "python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml "
                "{res}/junit-gpu_tier.xml tests/test_gpu_tier.py tests/test_resident_chunks.py",
                90, quote=r"passed|failed|Error")
    return (test,) + rows


def _masters_nvme_steps() -> tuple[Step, ...]:
    """Stage 3, optimizer and parameters on NVMe (configs/zero3-nvme.json), the model sized to
    the machine: the disk's rate, the largest Llama of SHAPE_4B's width whose paged run fits
    the free disk and whose resident run fits the host (benchmarks/masters_nvme_size.py, which
    prints why), the run with a host budget that holds every master and moment (masters on the
    host), the run with a budget of a quarter of the optimizer state (3 of its 12 bytes per
    parameter: the masters, and the gradient, page), then benchmarks/masters_nvme_check.py
    over the pair."""
    disk = Step("disk", "df -B1 {scratch}; free -b; rm -rf {scratch}/disk && mkdir -p "
                "{scratch}/disk && python3 -m zeroio.cli bench io --path {scratch}/disk --size 8G "
                "--raw dd --json --quiet > {res}/bench-io.json; python3 -c \"import json;r=json."
                "load(open('{res}/bench-io.json'));print('raw',r['raw'])\"; rm -rf {scratch}/disk",
                90, quote="raw")
    size = Step("size", "python3 benchmarks/masters_nvme_size.py --nvme {scratch}/nvme-size "
                "--out {res}/size.json; rc=$?; rm -rf {scratch}/nvme-size; exit $rc", 10,
                quote="masters-nvme size")
    read = "$(python3 -c \"import json;print(json.load(open('{res}/size.json'))['%s'])\")"

    def run(name: str, masters: str, budget: str, timeout_s: int) -> Step:
        nvme = "{scratch}/nvme-" + name
        sets = (f"--set zero_optimization.offload_param.nvme_path='\"{nvme}\"' --set "
                f"zero_optimization.offload_optimizer.masters='\"{masters}\"' --set "
                f"zero_optimization.tiering.cpu_budget_bytes={read % budget}")
        return Step(name, f"rm -rf {nvme}; python3 benchmarks/train_llama.py --mode zeroio "
                    f"--config configs/zero3-nvme.json --offload nvme --nvme-path {nvme} {sets} "
                    f"--zero-init --mem-log {read % 'args'} --seq 1024 --micro-batch 8 --steps 3 "
                    f"--warmup 1 --quiet --out {{res}}/{name}{{extra}}; rc=$?; rm -rf {nvme}; "
                    "exit $rc", timeout_s, quote=r"zeroio:|step \d|host rss|Error|error|Capacity")

    check = Step("check", "python3 benchmarks/masters_nvme_check.py --resident "
                 "$(ls {res}/resident/*.json | tail -1) --paged $(ls {res}/paged/*.json | tail -1) "
                 "--disk {res}/bench-io.json --out {res}/check", 10, quote=".")
    return (disk, size, run("resident", "host", "budget_resident", 120),
            run("paged", "auto", "budget_paged", 280), check)


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gpu-tests", "nvidia-h200", "every -m gpu test file on 1 GPU (2-GPU cases skip)",
          _pytest_steps(150)),
    Suite("gpu2-tests", "nvidia-h200-x2", "every -m gpu test file on 2 GPUs (NCCL cases run)",
          _pytest_steps(150)),
    Suite("peers", "nvidia-h200", "benchmarks/train_peers.py: zeroio, DeepSpeed and FSDP2 on "
          "the 1.364B shape, one contender per step", _peers_steps(1), peers=True),
    Suite("peers2", "nvidia-h200-x2", "the peers suite at --nproc 2", _peers_steps(2), peers=True),
    Suite("peers-wide", "nvidia-h200", "zeroio and DeepSpeed ZeRO-Offload z3/z2 on the 4.31B "
          "shape (hidden 4096, 20 layers, micro batch 8)", _peers_steps(1, WIDE_ROWS, SHAPE_4B),
          peers=True),
    Suite("capacity", "nvidia-h200", "benchmarks/probe_largest.py: the estimate's plan, then "
          "one depth (--extra '--start-layers N', else the plan's)", (
              Step("plan", "python3 benchmarks/probe_largest.py --plan-only --nvme-dir "
                   "{scratch}/probe | tee {res}/probe-plan.txt", 30),
              Step("probe", "python3 benchmarks/probe_largest.py --nvme-dir {scratch}/probe "
                   "--max-tries 1 --timeout 450 --out {res}{extra}", 465),
          )),
    Suite("before-after", "nvidia-h200", "zeroio z2/z3 + CPU offload at the baseline in .old and "
          "at this tree, interleaved, one call", _before_after_steps(), extra_carry=(BEFORE,)),
    Suite("levers", "nvidia-h200", "zeroio z2/z3 + CPU offload under one switch each, one call "
          "(and the CPU Adam training GPU tests)", _levers_steps()),
    Suite("nvme15", "nvidia-h200", "the NVMe regime: fio's best over a sweep (zeroio bench io),"
          " then the 15.24B Llama for 3 steps at micro batch 1 (moments on NVMe)",
          _nvme_steps(1, 3, 400), extra_carry=(".dev",)),
    Suite("nvme15-accum", "nvidia-h200", "the disk's best, the NVMe step alone per I/O "
          "setting (bench_nvme_step.py), then the 15B with 16 micro-batches per optimizer step "
          "at the best setting", _accum_steps(), extra_carry=(".dev",)),
    Suite("train-20b", "nvidia-h200", "`zeroio train` plans and trains the 19.87B Llama of "
          "benchmarks/models/llama-20b for 3 steps (micro batch 1, seq 512) and writes the bf16 "
          "model; peaks of host, disk and GPU (benchmarks/peaks.py)",
          (_train_planned("20b", 512, 505),)),
    Suite("train-15b", "nvidia-h200", "`zeroio train` plans and trains the 15.24B Llama of "
          "benchmarks/models/llama-15b (the NVMe rows' shape) for 3 steps (micro batch 1, seq "
          "1024) and writes the bf16 model; peaks of host, disk and GPU",
          (_train_planned("15b", 1024, 505),)),
    Suite("train-15b-accum", "nvidia-h200", "the train-15b run with 16 micro-batches per "
          "optimizer step (`--grad-accum 16`): the plan for it, 3 steps, the export, peaks",
          (_train_planned("15b", 1024, 505, accumulation=16),)),
    Suite("growing-batch", "nvidia-h200", "the 4.31B shape at micro batch 8, 3 steps at seq 1024 "
          "then 2 at 4096 (resident chunks must yield), stages 2 and 3, defaults beside "
          "gpu_budget_bytes 0: s/step and peak GPU per step", _growing_steps()),
    Suite("masters-nvme", "nvidia-h200", "masters on NVMe: the largest Llama of the 4.31B shape's "
          "width that the free disk and host hold (2.69B on a 64 GiB disk), at stage 3 with a "
          "host budget of a quarter of its optimizer state beside the all-resident run (losses, "
          "host RSS, disk bytes per step against the swap plan, s/step and the disk's rate)",
          _masters_nvme_steps()),
    Suite("large-batch-peer", "nvidia-h200", "MegaTrain on the Llama-3-8B shape at seq 2048, "
          "micro batch 64 (its regime), after a smoke run on a small shape",
          _large_batch_steps("peer"), peers=True),
    Suite("large-batch-pair", "nvidia-h200", "the Llama-3-8B shape at seq 2048 in one call: "
          "zeroio at micro batch 8 x accumulation 8 (131k tokens a step), then MegaTrain at its "
          "micro batch 64 (its CPU Adam built first)", _large_batch_pair_steps(), peers=True),
    Suite("large-batch", "nvidia-h200", "zeroio on the Llama-3-8B shape at seq 2048: micro "
          "batch 8 x accumulation 1, then x 8 (131k tokens a step)", _large_batch_steps("zeroio")),
    Suite("train-default", "nvidia-h200", "`zeroio train` with no arguments, timed", (
        Step("train", "mkdir -p {scratch}/run && cd {scratch}/run && SECONDS=0; "
             "python3 -m zeroio.cli train; rc=$?; echo \"zeroio train: exit $rc in $SECONDS s\"; "
             "exit $rc", 480, quote="."),
    )),
)}


def run_params(suite: Suite, commit: str, extra: str = "") -> dict:
    """The device `run` tool's parameters for ``suite``."""
    cmd = f"ZEROIO_COMMIT={commit} python3 tools/device_batch.py {suite.name} --out $OUT"
    cmd += f" {extra}" if extra else ""
    if len(cmd) > MAX_COMMAND_CHARS or len(suite.carry) > MAX_CARRY:
        raise ValueError(f"{suite.name}: the run tool takes {MAX_COMMAND_CHARS} characters and "
                         f"{MAX_CARRY} carried paths; this is {len(cmd)} and {len(suite.carry)}")
    return {"command": cmd, "carry": suite.carry, "kind": suite.kind, "timeout_s": CALL_LIMIT_S}


def local_commit() -> str:
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                         capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def expand(step: Step, res: Path, scratch: Path, logs: Path, extra: str = "") -> str:
    return step.shell.format(res=res, scratch=scratch, logs=logs,
                             extra=f" {extra}" if extra else "")


SETUP = """set -e
rm -rf /tmp/site && mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
"""
"""The wheels that the machine lacks (zarr & co.: shared/tools/device-wheels.sh fills .whl)."""
SETUP_PEERS = """python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/*.whl
mkdir -p /tmp/libaio && for d in .peers/libaio*.deb; do dpkg -x "$d" /tmp/libaio; done
"""
CHECK = ("python3 -c \"import torch,importlib.util as u;print('torch',torch.__version__,'gpus',"
         "torch.cuda.device_count(),'missing',[m for m in ('pytest','hypothesis','zarr','psutil')"
         " if u.find_spec(m) is None])\"\nnvidia-smi -L || true\n")


def device_env(commit: str) -> dict[str, str]:
    env = dict(os.environ, ZEROIO_COMMIT=commit, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(["/tmp/site", str(REPO), str(REPO / "tests")])
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's JIT build breaks on 9.0a
    # build/ is git-ignored: DeepSpeed's JIT ops and inductor's cache survive on a warm machine
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "build" / "inductor"))
    return env


@dataclasses.dataclass
class Result:
    name: str
    status: str
    """ok | failed | timeout | skipped"""
    wall_s: float
    timeout_s: int
    note: str = ""
    quoted: list[str] = dataclasses.field(default_factory=list)


def run_step(step: Step, shell: str, timeout: float, env: dict[str, str], log: Path) -> Result:
    """``shell`` in its own process group, killed at ``timeout``; output to console and ``log``."""
    if timeout <= 0:
        return Result(step.name, "skipped", 0.0, 0, "no budget left")
    print(f"\n=== {step.name} (timeout {timeout:.0f} s): {shell}", flush=True)
    log.write_text(f"$ {shell}\n")
    t0 = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", 'set -o pipefail; (eval "$1") 2>&1 | tee -a "$2"', "-",
                             shell, str(log)], cwd=REPO, env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        status, note = ("ok", "") if proc.returncode == 0 else ("failed", "")
    except subprocess.TimeoutExpired:
        kill_group(proc)
        status, note = "timeout", f"killed after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()[1:] if ln.strip()]
    if status == "failed":
        errs = [ln for ln in lines if re.search(r"Error|FAILED|error:", ln)]
        note = f"exit code {proc.returncode}: {(errs or lines or [''])[-1][:200]}"
    print(f"=== {step.name}: {status} in {wall:.0f} s {note}", flush=True)
    quoted = [ln for ln in lines if re.search(step.quote, ln)][-QUOTED:] if step.quote else []
    return Result(step.name, status, wall, int(timeout), note, quoted)


def summary(suite: Suite, commit: str, results: list[Result]) -> str:
    out = [f"# {suite.name} (commit {commit})", "", "| step | status | wall s | timeout s | note |",
           "|---|---|---|---|---|"]
    out += [f"| {r.name} | {r.status} | {r.wall_s:.0f} | {r.timeout_s} | {r.note.replace('|', '/')} |"
            for r in results]
    for r in results:
        out += ["", f"{r.name}:", "", *[f"    {ln}" for ln in r.quoted]] if r.quoted else []
    return "\n".join(out) + "\n"


def pack(stage: Path, out: Path, name: str, text: str) -> Path:
    """Cap big logs, then write ``<name>.tar.gz`` and ``<name>-summary.md`` into ``out``."""
    for p in stage.rglob("*"):
        if p.is_file() and p.suffix in (".log", ".err", ".out") and p.stat().st_size > LOG_CAP_BYTES:
            with open(p, "rb") as f:
                f.seek(-LOG_CAP_BYTES, os.SEEK_END)
                tail = f.read()
            p.write_bytes(b"[cut to the last bytes]\n" + tail)
    (stage / "summary.md").write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(stage, arcname=name)
    tmp.replace(out / f"{name}.tar.gz")
    (out / f"{name}-summary.md").write_text(text)
    return out / f"{name}.tar.gz"


def run_suite(suite: Suite, out: Path, commit: str, *, extra: str = "", only: set[str] | None = None,
              budget_s: float = BUDGET_S, setup: str | None = None, stage_root: Path = STAGE,
              scratch_root: Path = SCRATCH) -> int:
    """Run ``suite`` (``setup`` replaces the wheel install, for tests); pack after every step."""
    t0 = time.perf_counter()
    stage = stage_root / suite.name
    res, logs, scratch = stage / "results", stage / "logs", scratch_root / suite.name
    for d in (res, logs, scratch):
        d.mkdir(parents=True, exist_ok=True)
    env = device_env(commit)
    (stage / "provenance.json").write_text(json.dumps(
        {"suite": suite.name, "commit": commit, "kind": suite.kind, "extra": extra,
         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    if setup is None:
        setup = SETUP + (SETUP_PEERS if suite.peers else "") + CHECK
    results = [run_step(Step("setup", setup, suite.setup_s), setup, suite.setup_s, env,
                        logs / "setup.log")]
    pack(stage, out, suite.name, summary(suite, commit, results))
    for step in suite.steps if results[0].status == "ok" else ():
        if only is not None and step.name not in only:
            continue
        left = budget_s - (time.perf_counter() - t0)
        results.append(run_step(step, expand(step, res, scratch, logs, extra),
                                min(step.timeout_s, left), env, logs / f"{step.name}.log"))
        pack(stage, out, suite.name, summary(suite, commit, results))
    text = summary(suite, commit, results)
    print("\n" + text, flush=True)
    return 0 if all(r.status == "ok" for r in results) else 1


def describe(suite: Suite, commit: str, extra: str = "") -> str:
    res, scratch, logs = (STAGE / suite.name / "results", SCRATCH / suite.name,
                          STAGE / suite.name / "logs")
    lines = [f"{suite.name} ({suite.kind}, carry {suite.carry}): {suite.what}",
             f"  setup: timeout {suite.setup_s} s"]
    lines += [f"  {s.name}: timeout {s.timeout_s} s\n    $ {expand(s, res, scratch, logs, extra)}"
              for s in suite.steps]
    total = suite.setup_s + sum(s.timeout_s for s in suite.steps)
    lines.append(f"  total {total} s of timeouts, budget {BUDGET_S} s (steps past it are skipped)")
    lines.append("  run: " + json.dumps(run_params(suite, commit)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", nargs="?", choices=sorted(SUITES))
    ap.add_argument("--out", type=Path, help="where the tarball and summary go ($OUT)")
    ap.add_argument("--list", action="store_true", help="every suite, its steps and timeouts")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--print-run", action="store_true", help="the `run` tool's parameters (JSON)")
    ap.add_argument("--only", help="comma-separated step names to run (e.g. the ones a cut-off "
                                   "call skipped)")
    ap.add_argument("--extra", default="", help="appended to the peers rows (e.g. '--set K=V') "
                                                "and the capacity probe (e.g. '--start-layers 32')")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds for setup and steps (the device tool's call limit minus packing)")
    args = ap.parse_args(argv)
    commit = os.environ.get("ZEROIO_COMMIT") or local_commit()
    if args.list:
        print("\n\n".join(describe(s, commit) for s in SUITES.values()))
        return 0
    if args.suite is None:
        ap.error("name a suite (or --list)")
    suite = SUITES[args.suite]
    passthrough = " ".join(f"{k} {shlex.quote(v)}" for k, v in
                           (("--only", args.only or ""), ("--extra", args.extra)) if v)
    if args.print_run:
        print(json.dumps(run_params(suite, commit, passthrough)))
        return 0
    if args.dry_run:
        print(describe(suite, commit, args.extra))
        return 0
    if args.out is not None and not os.environ.get("ZEROIO_COMMIT"):
        # on the device machine the copy's .git is the one of the machine's first call:
        # its HEAD is not the code that runs (--print-run puts ZEROIO_COMMIT in the command)
        ap.error("set ZEROIO_COMMIT=<the commit of this tree> (the device copy's git HEAD "
                 "can be stale); --print-run gives the whole command")
    if args.out is None:
        ap.error("--out is required to run a suite (on the device: --out $OUT)")
    only = set(args.only.split(",")) if args.only else None
    return run_suite(suite, args.out, commit, extra=args.extra, only=only, budget_s=args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
