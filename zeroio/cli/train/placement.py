"""`zeroio train --plan`: the placement chosen for the machine the run is on (zeroio/plan.py).

[Note: planned runs]
- When. ``--plan`` plans; ``--no-plan`` trains with the given (or built-in) config as it is.
  With neither, a run plans when it names its model by ``--model-config`` and gives no
  ``--config``, or gives ``--machine``; every other run (the built-in tiny default, a
  preset, a user config) keeps its config's placement.
- What zeroio chooses. The placement keys: ``zero_optimization.stage``, ``sub_group_size``,
  the ``offload_optimizer`` and ``offload_param`` blocks (device, ``ratio``, ``nvme_path`` =
  ``--nvme-path`` or ``--output``/nvme, ``pin_memory`` on CUDA, the NVMe optimizer's read
  ahead / write behind) and ``tiering.cpu_budget_bytes``. Everything else comes from the
  built-in config or ``--config`` and the options, as in an unplanned run. A ``--config``
  that sets a placement key does not leave the placement to zeroio: with ``--plan`` that is
  a ConfigError naming the key (as is ``--ratio``).
- The machine. ``--machine FILE`` (``zeroio estimate --plan --machine``'s JSON) or measured
  now (machine.py, [Note: measuring the machine]); ``gpus`` is the ranks per node. Under an
  outside launcher with more than one rank every rank would measure at once, so there
  ``--machine`` is required.
- Once per job. The process that launches the ranks (or the only rank) plans, prints the
  plan block on stderr (not with ``--quiet`` / ``--json``), and writes it to
  ``--output``/zeroio-plan.json; the ranks it launched read that file, so every rank trains
  the same placement. Under an outside launcher each rank plans from the same ``--machine``
  file (the planner is deterministic) and rank 0 writes the file. When nothing fits, the
  ``CapacityError`` (each tier's overflow in bytes) ends the job before anything is written.
- CPU devices. Where the ranks' device is the CPU, the state the plan puts on the "GPU"
  lives in host memory too, and the tiered store counts it against its host budget; the
  applied ``tiering.cpu_budget_bytes`` is then the plan's plus the plan's device bytes per
  rank (a note of the plan says so). With a measured machine the two were taken from
  separate halves of the host memory (machine.py), so the sum stays within it.
- The record. The summary (``--json``) carries the plan under ``"plan"`` with the measured
  step time (median after step 1) beside the predicted one, and the engine's placement
  (``engine.stats()["placement"]``) under ``"placement"``: the candidates are counted with the
  run config's buffer keys (``buffer_keys``), so it equals the plan's ``buffer_placement``
  buffer by buffer ([Note: one placement] in zeroio/placement.py).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroio.errors import CapacityError, ConfigError

PLAN_FILE = "zeroio-plan.json"
_FORMAT = "zeroio-plan"
#: zero_optimization keys the plan decides ([Note: planned runs])
PLACEMENT_KEYS = ("stage", "sub_group_size", "offload_optimizer", "offload_param",
                  "tiering.cpu_budget_bytes")


def planning(opts) -> bool:
    """Whether this run plans its placement ([Note: planned runs], "When")."""
    if opts.plan is not None:
        return opts.plan
    return opts.machine is not None or (opts.model_config is not None and opts.config is None)


def _sets(zo: dict, key: str) -> bool:
    head, _, tail = key.partition(".")
    if head not in zo:
        return False
    return not tail or (isinstance(zo[head], dict) and tail in zo[head])


def check_options(opts, user_raw: dict | None) -> None:
    """ConfigError for options that contradict planning (or need it); ``user_raw``: the
    --config file's object, None without one."""
    if opts.plan is False and opts.machine is not None:
        raise ConfigError(f"--machine {opts.machine} describes the machine --plan plans for; "
                          "drop --no-plan or --machine", key="machine")
    if not planning(opts):
        if opts.nvme_path is not None and user_raw is not None:
            raise ConfigError(f"--nvme-path sets nvme_path of the built-in or planned config; "
                              f"with --config {opts.config} set nvme_path in that file, or add "
                              "--plan", key="nvme_path")
        return
    if opts.ratio is not None:
        raise ConfigError(f"--ratio {opts.ratio:g} does not go with --plan, which chooses "
                          "zero_optimization.offload_optimizer.ratio; drop --ratio, or pass "
                          "--no-plan", key="ratio")
    zo = (user_raw or {}).get("zero_optimization") or {}
    for key in PLACEMENT_KEYS:
        if isinstance(zo, dict) and _sets(zo, key):
            raise ConfigError(f"--plan chooses zero_optimization.{key}, but --config "
                              f"{opts.config} sets it; remove it from the file to leave the "
                              "placement to zeroio, or pass --no-plan to train with the file's",
                              key=f"zero_optimization.{key}")


def nvme_path(opts) -> Path:
    return Path(opts.nvme_path) if opts.nvme_path else Path(opts.output) / "nvme"


def applied_zero(block: dict[str, Any], nvme: Path, *, cuda: bool) -> dict[str, Any]:
    """The plan's ``zero_optimization`` block as the run applies it: the real ``nvme_path``,
    pinned buffers on CUDA, read ahead / write behind for the NVMe optimizer."""
    zero = copy.deepcopy(block)
    for name in ("offload_optimizer", "offload_param"):
        off = zero.get(name)
        if off is None:
            continue
        off["pin_memory"] = cuda
        if off["device"] == "nvme":
            off["nvme_path"] = str(nvme)
            if name == "offload_optimizer":
                off.update(pipeline_read=True, pipeline_write=True)
    return zero


def apply(raw: dict[str, Any], zero: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (the built-in config or the user's, which sets no placement key) with the
    planned placement keys."""
    zo = {k: v for k, v in (raw.get("zero_optimization") or {}).items()
          if k not in ("offload_optimizer", "offload_param")}
    zo.update({k: copy.deepcopy(v) for k, v in zero.items() if k != "tiering"})
    if "tiering" in zero:
        zo["tiering"] = {**(zo.get("tiering") or {}), **zero["tiering"]}
    return {**raw, "zero_optimization": zo}


def _dtype(raw: dict[str, Any], cuda: bool) -> str:
    """The run's 16-bit dtype as the config will resolve it ("auto" bf16: on CUDA)."""
    for name in ("fp16", "bf16"):
        enabled = (raw.get(name) or {}).get("enabled", False)
        if enabled is True:
            return name
        if enabled == "auto" and name == "bf16" and cuda:
            return "bf16"
    return "fp32"


def _typed_or_config(typed: int | None, raw: dict[str, Any], key: str, default: int) -> int:
    """The option as typed, else the config's ``key`` where it is a positive number, else
    ``default`` (an "auto" is filled from the option's default)."""
    if typed is not None:
        return typed
    v = raw.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


BUFFER_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
               "stage3_max_live_parameters")
"""``zero_optimization`` keys that size the buffers the estimate counts (not placement keys)."""


def buffer_keys(raw: dict[str, Any], *, hidden: int) -> dict[str, Any]:
    """The run config's ``BUFFER_KEYS`` it sets, "auto" resolved for the model (``hidden``), so
    the plan counts the buckets the run will hold ([Note: one placement] in
    zeroio/placement.py); an unset ``overlap_comm`` follows the planned stage."""
    from zeroio.config import load_config

    zo = raw.get("zero_optimization") or {}
    given = {k: zo[k] for k in BUFFER_KEYS if k in zo and zo[k] is not None}
    zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": given},
                       hidden_size=hidden).zero_optimization
    return {k: getattr(zero, k) for k in given if not (k == "overlap_comm" and zo[k] == "auto")}


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """The plan of one job as every rank applies it and the summary records it."""

    zero: dict[str, Any]
    """The applied placement keys of ``zero_optimization``."""
    record: dict[str, Any]
    """``zeroio-plan.json``: ``Plan.to_dict()`` under "plan", the machine's source, notes."""
    text: str = ""
    """The printed block (empty when read back from the file)."""

    @property
    def predicted_step_s(self) -> float:
        return float(self.record["plan"]["step_s"])

    def summary(self, step_seconds: list[float]) -> dict[str, Any]:
        """The summary's "plan": the record, the applied keys, measured beside predicted."""
        steady = step_seconds[1:] or step_seconds
        return {**self.record, "zero_optimization": self.zero,
                "predicted_step_s": self.predicted_step_s,
                "measured_step_s": statistics.median(steady) if steady else None}


def _machine(opts, *, gpus: int, cuda: bool, outside_world: int | None):
    """(Machine, source, notes): from --machine, or measured here ([Note: planned runs])."""
    from zeroio.cli.train import machine as probe
    from zeroio.plan import Machine

    if opts.machine is not None:
        m = Machine.from_json(opts.machine)
        if m.gpus != gpus:
            raise ConfigError(f"--machine {opts.machine} has gpus = {m.gpus}, but this run has "
                              f"{gpus} rank(s) per node; set gpus to {gpus} or change --nproc",
                              key="machine.gpus")
        return m, str(opts.machine), ()
    if outside_world is not None and outside_world > 1:
        raise ConfigError("--plan under an outside launcher needs --machine FILE (every rank "
                          "would measure the machine at once); or run `zeroio train --nproc N`, "
                          "which measures once before launching, or pass --no-plan",
                          key="machine")
    if cuda:
        got = probe.measure_in_child(gpus=gpus, nvme_path=nvme_path(opts))
    else:
        got = probe.measure(gpus=gpus, nvme_path=nvme_path(opts), cuda=False)
    return got.machine, f"measured in {got.seconds:.1f} s", got.notes


def make(opts, mcfg, *, gpus: int, nodes: int, cuda: bool,
         outside_world: int | None = None) -> RunPlan:
    """Plan this job: the machine, ``plan_placement`` for the model and the run's micro batch
    and sequence, the applied keys and the printed block. CapacityError when nothing fits."""
    from zeroio.cli.train.presets import num_parameters
    from zeroio.cli.train.run_config import DEFAULT_GRAD_ACCUM, DEFAULT_MICRO_BATCH, base_config
    from zeroio.plan import plan_placement

    raw = base_config(opts, cuda=cuda)
    machine, source, notes = _machine(opts, gpus=gpus, cuda=cuda, outside_world=outside_world)
    n = num_parameters(mcfg)
    layers = mcfg.num_hidden_layers
    emb = mcfg.vocab_size * mcfg.hidden_size * (1 if mcfg.tie_word_embeddings else 2)
    micro_batch = _typed_or_config(opts.micro_batch, raw, "train_micro_batch_size_per_gpu",
                                   DEFAULT_MICRO_BATCH)
    accumulation = _typed_or_config(opts.grad_accum, raw, "gradient_accumulation_steps",
                                    DEFAULT_GRAD_ACCUM)
    try:
        plan = plan_placement(n, machine, dtype=_dtype(raw, cuda), micro_batch=micro_batch,
                              seq=opts.seq_len, layers=layers, hidden=mcfg.hidden_size,
                              vocab=mcfg.vocab_size, intermediate=mcfg.intermediate_size,
                              largest_group=(n - emb - mcfg.hidden_size) // layers, nodes=nodes,
                              accumulation=accumulation,
                              buffers=buffer_keys(raw, hidden=mcfg.hidden_size))
    except CapacityError as e:
        raise CapacityError(f"--plan: the model ({n:,} parameters) does not fit the machine "
                            f"({source}): {e}. Nothing was trained") from None
    zero = applied_zero(plan.config["zero_optimization"], nvme_path(opts), cuda=cuda)
    notes = list(notes)
    if not cuda and "tiering" in zero:
        # [Note: planned runs], "CPU devices": the device's state counts against the host budget
        device = plan.tiers[0].need_bytes
        zero["tiering"]["cpu_budget_bytes"] += device
        notes.append(f"CPU device: tiering.cpu_budget_bytes {zero['tiering']['cpu_budget_bytes']:,}"
                     f" = the plan's {zero['tiering']['cpu_budget_bytes'] - device:,} + the "
                     f"{device:,} bytes of device state, which live in host memory too")
    record = {"format": _FORMAT, "version": 1, "machine_source": source, "notes": notes,
              "placement": plan.placement, "plan": plan.to_dict()}
    return RunPlan(zero=zero, record=record, text=render(plan, source, notes, zero))


def render(plan, source: str, notes, zero: dict[str, Any]) -> str:
    """The block printed before step 1: the machine, every tier against its budget, the
    traffic and predicted step time, the rejected placements, the applied keys."""
    from zeroio.cli.estimate_plan import render_fit
    from zeroio.plan import MARGIN

    m = plan.machine
    lines = [f"zeroio train --plan: machine ({source})"] + [f"  {n}" for n in notes]
    lines.append(f"  {m.gpus} GPU(s) x {m.gpu_bytes / 1e9:.2f} GB, host {m.host_bytes / 1e9:.2f} "
                 f"GB, disk {m.disk_bytes / 1e9:.2f} GB free; host<->GPU {m.pcie_bps / 1e9:.2f} "
                 f"GB/s, disk read {m.disk_read_bps / 1e9:.2f} / write "
                 f"{m.disk_write_bps / 1e9:.2f} GB/s"
                 + (f" ({m.disk_mixed_bps / 1e9:.2f} together)" if m.disk_mixed_bps else "")
                 + ", CPU Adam "
                 f"{m.cpu_adam_elems_per_s / 1e9:.3f} G elements/s")
    lines += render_fit(plan)
    if not plan.reasons:
        lines += ["", "placements earlier in the list that do not fit: none"]
    lines += ["", "applied: zero_optimization " + json.dumps(zero, sort_keys=True),
              f"(GB = 1e9 bytes; {MARGIN:.0%} of GPU and host memory left free)"]
    return "\n".join(lines)


def job_plan(opts, mcfg, *, nproc: int, cuda: bool) -> RunPlan | None:
    """The plan of a job about to start, made by the process that launches its ranks (or the
    only rank, or each rank under an outside launcher); None when the run does not plan.
    Rank 0 prints the block and writes ``--output``/zeroio-plan.json."""
    from zeroio.config.launch_env import launch_env

    if not planning(opts):
        return None
    env = launch_env()
    outside = env.rank is not None
    gpus = (env.local_world_size or 1) if outside else nproc
    world = (env.world_size or 1) if outside else nproc
    rp = make(opts, mcfg, gpus=gpus, nodes=max(1, world // gpus), cuda=cuda,
              outside_world=world if outside else None)
    if (env.rank or 0) == 0:
        if not (opts.quiet or opts.json):
            print(rp.text, file=sys.stderr, flush=True)
        write(Path(opts.output), rp)
    return rp


def write(out: Path, rp: RunPlan) -> None:
    from zeroio.io.files import atomic_write_text

    atomic_write_text(out / PLAN_FILE, json.dumps({**rp.record, "zero_optimization": rp.zero}))


def read(out: Path) -> RunPlan:
    """The plan the launching process wrote for this job (ConfigError if there is none)."""
    from zeroio.config.loader import read_config

    path = out / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"--plan: {path} is missing; the process that launched this rank "
                          "writes it before launching", key="plan")
    doc = read_config(path)
    if doc.get("format") != _FORMAT or not isinstance(doc.get("zero_optimization"), dict):
        raise ConfigError(f"--plan: {path} is not a zeroio plan file", key="plan")
    zero = doc.pop("zero_optimization")
    return RunPlan(zero=zero, record=doc)
