"""What every contender of the side-by-side benchmark shares: the model, the batches, the clock.

Each contender runs in its own process (train_peers.py launches it) and must
train the *same* model on the *same* tokens, so the shape, the seed and the
batch generator live here, once:

- ``ModelSpec``: the Llama shape (the 1.364B model by default) and the
  run's batch geometry; ``llama_config`` turns it into a transformers config.
- ``build_model`` is train_llama.py's own (imported, not copied): weights
  from torch.manual_seed(0), so every contender starts from the same model.
- ``BatchStream(spec, rank)``: train_llama.py's token stream (a generator
  seeded with the rank, one ``randint`` of (micro_batch, seq) per step), so
  every contender at any world size trains on the same tokens.
- ``HostPeak``: peak resident set size of this process, sampled by a thread
  (``ru_maxrss`` alone misses nothing but cannot be reset; the sampler gives
  the peak *during training*, after model build, too).
- ``summarize``: the numbers every row of the table carries, computed one way.

[Note: what "s/step" means] A step is forward + backward + optimizer step of
one micro batch per rank, timed with the device synchronised at both ends.
The figure is the median over the steps after ``warmup`` (the first steps
pay for allocator growth, JIT compilation and NVMe file creation).
tokens/s counts every rank's tokens: micro_batch x seq x world / (s/step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

import torch

GIB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A Llama-style decoder (untied embeddings, no GQA) and the batch it trains on."""

    hidden: int = 2048
    """Model width."""
    layers: int = 24
    """Decoder layers."""
    intermediate: int = 5632
    """MLP inner width."""
    heads: int = 16
    """Attention heads (key/value heads are the same number)."""
    vocab: int = 32000
    """Vocabulary size; embeddings and LM head are separate matrices."""
    seq: int = 1024
    """Tokens per sequence."""
    micro_batch: int = 8
    """Sequences per rank per step."""

    def to_args(self) -> list[str]:
        """The command-line flags that rebuild this spec in a runner (``add_spec_args``)."""
        return [
            "--hidden", str(self.hidden), "--layers", str(self.layers),
            "--intermediate", str(self.intermediate), "--heads", str(self.heads),
            "--vocab", str(self.vocab), "--seq", str(self.seq),
            "--micro-batch", str(self.micro_batch),
        ]

    @property
    def num_params(self) -> int:
        """Parameter count from the shape alone (matches LlamaForCausalLM's)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        per_layer = 4 * h * h + 3 * h * i + 2 * h  # q,k,v,o; gate,up,down; two RMSNorms
        return self.layers * per_layer + 2 * v * h + h  # untied embed + head; final norm

    def tokens_per_step(self, world: int) -> int:
        return self.micro_batch * self.seq * world


def add_spec_args(parser) -> None:
    """Model and batch flags shared by train_peers.py and the runners."""
    d = ModelSpec()
    for field in dataclasses.fields(ModelSpec):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(d, field.name), help=field.__doc__)


def runner_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every runner takes: the model and batch (``add_spec_args``), ``--steps`` and
    ``--warmup``; a runner adds its own before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_spec_args(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    return parser


def spec_from_args(args) -> ModelSpec:
    return ModelSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSpec)})


def _train_llama():
    """benchmarks/train_llama.py as a module (it lives one folder up from this one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    parent = os.path.dirname(here)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    import train_llama

    return train_llama


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """train_llama.py's model for this shape: fp32 on the CPU, weights from seed 0."""
    ns = argparse.Namespace(hidden=spec.hidden, layers=spec.layers,
                            intermediate=spec.intermediate, heads=spec.heads, kv_heads=None,
                            vocab=spec.vocab, seq=spec.seq)
    return _train_llama().build_model(ns)


class BatchStream:
    """train_llama.py's synthetic tokens: Generator(rank), one (micro_batch, seq) draw per step."""

    def __init__(self, spec: ModelSpec, rank: int):
        self._spec = spec
        self._gen = torch.Generator().manual_seed(rank)

    def next(self) -> torch.Tensor:
        return torch.randint(0, self._spec.vocab, (self._spec.micro_batch, self._spec.seq),
                             generator=self._gen)


def adamw_hyper() -> dict[str, Any]:
    """The optimizer every contender uses: train_llama.py's plain AdamW (lr 3e-4, weight decay
    0.1, torch's betas and eps); clipping is 1.0 everywhere."""
    return {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


class HostPeak:
    """Peak RSS of this process while running (a sampling thread; also ``ru_maxrss``)."""

    def __init__(self, interval: float = 0.05):
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        """The peak in bytes: the sampled one, or ru_maxrss (KiB on Linux) if that saw more."""
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        return max(self._peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(step_seconds: list[float], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    """s/step median after warm-up and tokens/s from it (see [Note: what "s/step" means])."""
    timed = step_seconds[warmup:] if len(step_seconds) > warmup else step_seconds[-1:]
    if not timed:
        raise ValueError("no timed steps: run more steps than --warmup")
    med = statistics.median(timed)
    return {
        "s_per_step": med,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / med,
        "timed_steps": len(timed),
        "step_seconds": step_seconds,
    }


def peaks(device: torch.device, host_peak_bytes: int) -> dict[str, Any]:
    """This rank's peaks, then every rank's (an all-gather of numbers; no pickling)."""
    import torch.distributed as dist

    gpu_alloc = gpu_res = 0
    if device.type == "cuda":
        gpu_alloc = torch.cuda.max_memory_allocated(device)
        gpu_res = torch.cuda.max_memory_reserved(device)
    mine = torch.tensor([gpu_alloc, gpu_res, host_peak_bytes], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm_dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        out = [torch.zeros_like(mine, device=comm_dev) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine.to(comm_dev))
        rows = [t.cpu().tolist() for t in out]
    else:
        rows = [mine.tolist()]
    cuda = device.type == "cuda"
    return {
        "peak_gpu_bytes": max(int(r[0]) for r in rows) if cuda else None,
        "peak_gpu_reserved_bytes": max(int(r[1]) for r in rows) if cuda else None,
        "peak_host_rss_bytes": max(int(r[2]) for r in rows),
        "per_rank": [{"peak_gpu_bytes": int(r[0]), "peak_gpu_reserved_bytes": int(r[1]),
                      "peak_host_rss_bytes": int(r[2])} for r in rows],
    }


def emit(result: dict[str, Any]) -> None:
    """The runner's answer: one JSON line, last on stdout (train_peers.py reads the last one)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def init_world(device: torch.device, *, cpu_collectives: bool = False) -> tuple[int, int]:
    """Join torchrun's world (NCCL on GPUs, gloo on CPU) or make a world of one.
    ``cpu_collectives``: on GPUs, gloo for CPU tensors beside NCCL."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and cpu_collectives:
            backend = "cpu:gloo,cuda:nccl"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


class Clock:
    """Times steps with the device synchronised at both ends of each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: list[float] = []
        self._t = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t = time.perf_counter()

    def stop(self) -> None:
        sync(self.device)
        self.seconds.append(time.perf_counter() - self._t)
