"""``deepspeed.utils.logging`` on zeroio: the ``DeepSpeed`` logger, ``log_dist`` and
``see_memory_usage``.

The logger is DeepSpeed's: named ``"DeepSpeed"``, level INFO, its own handler on stdout,
not propagating (``deepspeed/utils/logging.py``). Setting its level is how DeepSpeed's
output is silenced (Lightning's ``DeepSpeedStrategy(logging_level=...)`` does
``deepspeed.utils.logging.logger.setLevel``), and it silences what the facade logs the
same way, zeroio's start-up banner included (banner.py).
"""

from __future__ import annotations

import functools
import gc
import logging
import sys

import psutil
import torch

from zeroio.deepspeed.ranks import get_rank, is_initialized

LOGGER_NAME = "DeepSpeed"
_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _create_logger() -> logging.Logger:
    log = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_zeroio", False) for h in log.handlers):
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._zeroio = True  # one handler however often the facade is imported
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.propagate = False
    return log


logger = _create_logger()


@functools.lru_cache(None)
def warning_once(*args, **kwargs) -> None:
    """``logger.warning`` once per distinct message (DeepSpeed's ``logger.warning_once``)."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def should_log(ranks) -> bool:
    """DeepSpeed's rule: always without a process group; else only on the ranks listed
    (``[-1]``: every rank; none listed: no rank)."""
    if not is_initialized():
        return True
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or get_rank() in set(ranks))


def log_dist(message, ranks=None, level=logging.INFO) -> None:
    """Log ``message`` as ``[Rank r] message`` on ``ranks`` (see ``should_log``)."""
    if should_log(ranks):
        my_rank = get_rank() if is_initialized() else -1
        logger.log(level, f"[Rank {my_rank}] {message}")


def print_configuration(args, name: str) -> None:
    """Every attribute of ``args``, one per line, at INFO (DeepSpeed's helper)."""
    logger.info(f"{name}:")
    for arg in sorted(vars(args)):
        logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(args, arg)}")


def _gb(n: float) -> float:
    return round(n / 2**30, 2)


def see_memory_usage(message, force: bool = False) -> None:
    """DeepSpeed's memory report on rank 0 when ``force``: the device allocator's allocated and
    cached GB and their peaks (0 without CUDA), and the host's used virtual memory. The
    device's peak counters are reset afterwards, as DeepSpeed does."""
    if not force or (is_initialized() and get_rank() != 0):
        return
    gc.collect()
    cuda = torch.cuda.is_available()
    alloc = torch.cuda.memory_allocated() if cuda else 0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    cached = torch.cuda.memory_reserved() if cuda else 0
    peak_cached = torch.cuda.max_memory_reserved() if cuda else 0
    vm = psutil.virtual_memory()
    logger.info(message)
    logger.info(f"MA {_gb(alloc)} GB         Max_MA {_gb(peak)} GB         "
                f"CA {_gb(cached)} GB         Max_CA {_gb(peak_cached)} GB ")
    logger.info(f"CPU Virtual Memory:  used = {_gb(vm.total - vm.available)} GB, "
                f"percent = {vm.percent}%")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
