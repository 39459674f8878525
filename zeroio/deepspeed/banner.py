"""What the ``deepspeed`` facade tells the user about which engine runs.

[Note: the start-up banner]
When ``deepspeed.initialize`` builds an engine, rank 0 prints one line on stdout (where
DeepSpeed's logger prints): zeroio's version and the DeepSpeed API it follows, the stage,
ranks and compute dtype, the offload devices with their NVMe paths, and the placement per
rank (where masters, moments, gradients and 16-bit parameters live, and the GB on each
tier). It is silenced as DeepSpeed's own output is: a level above INFO set on the
``DeepSpeed`` logger (``deepspeed.utils.logging.logger.setLevel``; Lightning's
``DeepSpeedStrategy`` sets WARNING by default), and also by transformers' verbosity above
WARNING (``TrainingArguments(log_level="error")``) or ``ZEROIO_BANNER=0``.

[Note: a DeepSpeed installation beside the import line]
Where a real DeepSpeed is installed, the one import line leaves it in place (DESIGN.md: a
real DeepSpeed is untouched outside ``zeroio launch``), so ``import deepspeed`` in
transformers, accelerate or Lightning gives DeepSpeed. Rank 0 then prints one WARNING on
stderr saying so, which engine runs, and how to train on zeroio instead.
"""

from __future__ import annotations

import logging
import sys

from zeroio.config import overrides
from zeroio.config.launch_env import launch_env
from zeroio.deepspeed.version import FOLLOWS

_HOMES = (("param16", "16-bit params"), ("master", "masters"), ("moments", "moments"),
          ("grad", "gradients"))


def _rank0() -> bool:
    return launch_env().rank in (None, 0)


def silenced() -> bool:
    """[Note: the start-up banner]: whether a log level or ``ZEROIO_BANNER=0`` silences it."""
    if not overrides.banner():
        return True
    level = logging.getLogger("DeepSpeed").level  # NOTSET: DeepSpeed's INFO
    if level > logging.INFO:
        return True
    hf = sys.modules.get("transformers.utils.logging")
    return hf is not None and hf.get_verbosity() > logging.WARNING


def _device(block) -> str:
    dev = block.device.value
    return f"{dev} ({block.nvme_path})" if dev == "nvme" and block.nvme_path else dev


def _tier_name(tier: str, device_type: str) -> str:
    """The placement's ``gpu`` tier is the compute device: on a run without an accelerator
    (gloo on CPU) it is named ``compute(cpu)``, not ``gpu``."""
    return tier if tier != "gpu" or device_type == "cuda" else f"compute({device_type})"


def _placement(placement, device_type: str) -> str:
    homes = []
    for kind, label in _HOMES:
        tiers = [_tier_name(t, device_type) for t, n in placement.buffer(kind).tiers.items() if n]
        if tiers:
            homes.append(f"{label} {'+'.join(tiers)}")
    sizes = ", ".join(f"{_tier_name(t, device_type)} {_size(placement.tier_bytes(t))}"
                      for t in ("gpu", "cpu", "nvme"))
    return f"{', '.join(homes)}; per rank {sizes}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def banner_line(engine) -> str:
    """The one line for a zeroio ``Engine`` ([Note: the start-up banner])."""
    from zeroio import __version__

    cfg = engine.config
    zero = cfg.zero_optimization
    return (f"[zeroio] zeroio {__version__} (DeepSpeed {FOLLOWS} API) | ZeRO stage {zero.stage}, "
            f"{engine.world_size} rank(s), {cfg.compute_dtype} | offload optimizer "
            f"{_device(zero.offload_optimizer)}, params {_device(zero.offload_param)} | "
            f"placement: {_placement(engine.placement, engine.device.type)}")


def announce(engine) -> None:
    """Print the banner on rank 0 unless silenced."""
    if engine.global_rank == 0 and not silenced():
        print(banner_line(engine), flush=True)


def warn_real_deepspeed(version: str | None, where: str) -> None:
    """[Note: a DeepSpeed installation beside the import line], on rank 0."""
    if not _rank0():
        return
    print(f"[zeroio] WARNING: DeepSpeed {version or '(unknown version)'} is installed ({where}): "
          "`import deepspeed` in transformers, accelerate and Lightning gives DeepSpeed, which "
          "trains; only zeroio.deepspeed's own functions run zeroio. To train on zeroio, start "
          "the script with `zeroio launch` (accelerate configs: `zeroio launch --config_file "
          "CFG.yaml`)", file=sys.stderr, flush=True)
