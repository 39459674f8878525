"""The contenders of the peers benchmark and the command line that runs each one as its own process.

plain PyTorch and zeroio run through benchmarks/train_llama.py (``--mode plain``
/ ``--mode zeroio --config FILE``); DeepSpeed through ds_runner.py on the very
same config files (configs.py); FSDP2 through fsdp2_runner.py. All get the
same model shape and step counts as flags, and build the model and tokens
the same way (common.py imports train_llama's builder).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from common import ModelSpec

from configs import Setup, ds_config, write_config

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
REPO = BENCH.parent


class Engine(enum.Enum):
    PLAIN = "plain"
    ZEROIO = "zeroio"
    DEEPSPEED = "deepspeed"
    FSDP2 = "fsdp2"
    TORCHAO = "torchao"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contender:
    name: str
    engine: Engine
    setup: Setup | None = None
    label: str = ""
    """What the row says about it in the table."""
    overrides: tuple[tuple[str, Any], ...] = ()
    """Config keys set on top of the setup's (after the run's own ``--set`` pairs)."""


CONTENDERS: tuple[Contender, ...] = (
    Contender(name="plain", engine=Engine.PLAIN,
              label="plain PyTorch, fused AdamW on GPU, no offload"),
    Contender(name="zeroio-z2-cpu", engine=Engine.ZEROIO, setup=Setup.Z2_CPU,
              label="zeroio ZeRO-2, optimizer on CPU"),
    Contender(name="zeroio-z3-cpu", engine=Engine.ZEROIO, setup=Setup.Z3_CPU,
              label="zeroio ZeRO-3, params + optimizer on CPU"),
    Contender(name="zeroio-z2-cpu-streamed", engine=Engine.ZEROIO, setup=Setup.Z2_CPU,
              label="zeroio ZeRO-2, optimizer on CPU, none of it kept on the GPU "
                    "(tiering.gpu_budget_bytes 0: DeepSpeed's placement)",
              overrides=(("zero_optimization.tiering.gpu_budget_bytes", 0),)),
    Contender(name="zeroio-z3-cpu-streamed", engine=Engine.ZEROIO, setup=Setup.Z3_CPU,
              label="zeroio ZeRO-3, params + optimizer on CPU, none of it kept on the GPU "
                    "(tiering.gpu_budget_bytes 0)",
              overrides=(("zero_optimization.tiering.gpu_budget_bytes", 0),)),
    Contender(name="zeroio-z3-nvme", engine=Engine.ZEROIO, setup=Setup.Z3_NVME,
              label="zeroio ZeRO-3, params + optimizer on NVMe"),
    Contender(name="zeroio-z3-nvme-stream", engine=Engine.ZEROIO, setup=Setup.Z3_NVME_STREAM,
              label="zeroio ZeRO-3 on NVMe, optimizer host budget 1/4 of the moments"),
    Contender(name="ds-z2-cpu", engine=Engine.DEEPSPEED, setup=Setup.Z2_CPU,
              label="DeepSpeed ZeRO-2, optimizer on CPU"),
    Contender(name="ds-z3-cpu", engine=Engine.DEEPSPEED, setup=Setup.Z3_CPU,
              label="DeepSpeed ZeRO-3, params + optimizer on CPU"),
    Contender(name="ds-z3-nvme", engine=Engine.DEEPSPEED, setup=Setup.Z3_NVME,
              label="DeepSpeed ZeRO-3, params + optimizer on NVMe"),
    Contender(name="ds-z2-zenflow", engine=Engine.DEEPSPEED, setup=Setup.Z2_ZENFLOW,
              label="DeepSpeed ZenFlow ZeRO-2 (inexact: top-k on GPU, rest late on CPU); "
                    "s/step = mean over whole update windows after the first update"),
    Contender(name="ds-z3-zenflow", engine=Engine.DEEPSPEED, setup=Setup.Z3_ZENFLOW,
              label="DeepSpeed ZenFlow ZeRO-3 (inexact)"),
    Contender(name="ds-z3-twinflow", engine=Engine.DEEPSPEED, setup=Setup.Z3_TWIN,
              label="DeepSpeed ZeRO-3 twin-flow (offload_optimizer.ratio 0.8, sub_group_size 1e8)"),
    Contender(name="ds-z3-superoffload", engine=Engine.DEEPSPEED, setup=Setup.Z3_SUPER,
              label="DeepSpeed ZeRO-3 SuperOffload (offload_optimizer.super_offload)"),
    Contender(name="fsdp2-cpu", engine=Engine.FSDP2,
              label="FSDP2 CPUOffloadPolicy, fused CPU AdamW"),
    Contender(name="torchao-cpu", engine=Engine.TORCHAO,
              label="torchao CPUOffloadOptimizer (fused CPU AdamW, gradients offloaded)"),
)
BY_NAME = {c.name: c for c in CONTENDERS}


def select(only: str | None) -> list[Contender]:
    """``--only a,b,c`` -> those contenders in table order; unknown names are an error."""
    if not only:
        return list(CONTENDERS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"--only: unknown contender(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(BY_NAME)}")
    return [c for c in CONTENDERS if c.name in names]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """Everything about a benchmark run that every contender's command depends on."""

    spec: ModelSpec
    steps: int
    warmup: int
    nproc: int
    run_dir: Path
    """Per-run folder: configs, logs, train_llama's own result files."""
    nvme_dir: Path
    """Parent of each NVMe contender's own swap folder."""
    python: str = sys.executable
    libaio_dir: Path | None = None
    ds_cuda_arch: str = "9.0"
    overrides: tuple[tuple[str, Any], ...] = ()
    """``--set KEY.PATH=JSON`` pairs applied to every contender's config file (zeroio and
    DeepSpeed read the same file; ds_runner drops zeroio-only keys such as
    zero_optimization.tiering), so e.g. offload_optimizer.ratio applies to both."""


def world_of(c: Contender, plan: RunPlan) -> int:
    """Ranks the contender runs on: train_llama's plain mode and torchao's single-GPU
    optimizer have no data parallelism."""
    return 1 if c.engine in (Engine.PLAIN, Engine.TORCHAO) else plan.nproc


def skip_reason(c: Contender, plan: RunPlan) -> str | None:
    """Why the contender cannot run here (checked before launching), or None."""
    if c.engine is Engine.DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        return ("deepspeed is not installed in this Python: pip install the wheel and its "
                "deps from .peers/ (docs/benchmarks.md)")
    if c.engine is Engine.TORCHAO and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed in this Python: pip install its wheel from .peers/"
    return None


def nvme_folder(c: Contender, plan: RunPlan) -> Path:
    return plan.nvme_dir / c.name


def config_path(c: Contender, plan: RunPlan) -> Path:
    """Write the contender's DeepSpeed-schema config into the run folder; return its path."""
    cfg = ds_config(c.setup, plan.spec, world_of(c, plan),
                    nvme_folder(c, plan) if c.setup is not None and c.setup.on_nvme else None)
    for key, value in plan.overrides + c.overrides:
        node = cfg
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return write_config(cfg, plan.run_dir / "configs" / f"{c.name}.json")


def omp_threads(world: int) -> str | None:
    """OMP_NUM_THREADS for every rank of a multi-rank contender: the CPUs over the ranks, as
    torchrun's warning asks users to set (its default, 1, made DeepSpeed's CPU Adam
    single-threaded: 1.98 s/step at 2 ranks against 0.89 at 1 in train_peers.py --nproc 2). None: leave it
    (one rank, or the caller set OMP_NUM_THREADS)."""
    if world == 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return str(max(1, len(os.sched_getaffinity(0)) // world))


def _launcher(plan: RunPlan, world: int, script: Path) -> list[str]:
    if world == 1:
        return [plan.python, str(script)]
    return [plan.python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", str(script)]


def command(c: Contender, plan: RunPlan) -> tuple[list[str], dict[str, str]]:
    """argv and environment for the contender."""
    env = dict(os.environ)
    world = world_of(c, plan)
    if (threads := omp_threads(world)) is not None:
        env["OMP_NUM_THREADS"] = threads
    steps = ["--steps", str(plan.steps), "--warmup", str(plan.warmup)]
    spec_args = plan.spec.to_args()
    if c.engine in (Engine.PLAIN, Engine.ZEROIO):
        argv = _launcher(plan, world, BENCH / "train_llama.py") + [
            "--mode", c.engine.value, *spec_args, *steps, "--json", "--quiet",
            "--out", str(plan.run_dir / "train_llama")]
        if c.engine is Engine.ZEROIO:
            argv += ["--config", str(config_path(c, plan))]
        return argv, env
    if c.engine is Engine.DEEPSPEED:
        argv = _launcher(plan, world, HERE / "ds_runner.py") + [
            "--config", str(config_path(c, plan)), "--name", c.name, *spec_args, *steps]
        env.setdefault("TORCH_CUDA_ARCH_LIST", plan.ds_cuda_arch)
        if world == 1:  # no launcher: DeepSpeed still asserts that LOCAL_RANK is set
            env.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        if plan.libaio_dir is not None:
            env.update(libaio_env(plan.libaio_dir, env))
        return argv, env
    if c.engine is Engine.TORCHAO:
        return [plan.python, str(HERE / "torchao_runner.py"), *spec_args, *steps], env
    argv = _launcher(plan, world, HERE / "fsdp2_runner.py") + [*spec_args, *steps]
    return argv, env


def libaio_env(root: Path, base: dict[str, str]) -> dict[str, str]:
    """Compiler/linker/loader paths for libaio unpacked with ``dpkg -x libaio*.deb ROOT``."""
    inc = root / "usr" / "include"
    libs = sorted({p.parent for p in root.glob("usr/lib/**/libaio.so*")}) or [root / "usr" / "lib"]
    if not (inc / "libaio.h").is_file():
        raise SystemExit(f"--libaio-dir {root}: no usr/include/libaio.h there; unpack it with "
                         f"'dpkg -x libaio-dev_*.deb {root}' (and libaio1_*.deb)")
    lib = ":".join(str(p) for p in libs)

    def prepend(key: str, value: str, sep: str) -> str:
        old = base.get(key, "")
        return value + (sep + old if old else "")

    return {
        "CFLAGS": prepend("CFLAGS", f"-I{inc}", " "),
        "LDFLAGS": prepend("LDFLAGS", " ".join(f"-L{p}" for p in libs), " "),
        "CPATH": prepend("CPATH", str(inc), ":"),
        "LIBRARY_PATH": prepend("LIBRARY_PATH", lib, ":"),
        "LD_LIBRARY_PATH": prepend("LD_LIBRARY_PATH", lib, ":"),
    }
