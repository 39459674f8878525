"""MegaTrain (github DLYuanGod/MegaTrain) on a random-init Llama, timed like train_llama.py.

MegaTrain is never vendored: its ``infinity`` package is fetched separately and named by
``--megatrain-dir`` (the folder holding ``infinity/``). Facts this runner relies on (its
``CPUMasterModel`` in infinity/model/cpu_master.py and its loop in examples/sft/train.py):

- the model is a Hugging Face model in bf16 in host memory, handed to ``CPUMasterModel``; its
  loader only knows ``from_pretrained``, so the runner builds the random-init model itself;
- every decoder layer gets the 2-D padding mask, which only ``flash_attention_2`` accepts; the
  GPU machine has no flash-attn package, so the layers run ``causal_sdpa``, registered here:
  causal sdpa with the mask dropped, which is what flash-attn computes for unpadded batches
  (every batch here is unpadded: random token ids, all-ones mask);
- its step: ``forward_and_backward`` (gradients land in the host parameters' ``.grad``),
  ``clip_grad_norm_`` to 1.0, the optimizer's step over ``get_parameters()`` (DeepSpeed's CPU
  Adam when importable, as its loop picks; else torch AdamW), ``_sync_params_to_gpu``,
  ``zero_grad`` of model and optimizer.

The row: s/step (median after ``--warmup``), tokens/s and model TFLOPS = 6 * N * tokens/s (its
own loop's formula), peak GPU and host RSS, losses; JSON into ``--out``.

    python benchmarks/peers/megatrain_runner.py --megatrain-dir .peers/megatrain \\
        --hidden 4096 --layers 32 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 2048 --micro-batch 64 --steps 4 --warmup 1 --out results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import provenance  # noqa: E402  (benchmarks/provenance.py)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatrain-dir", type=Path, required=True,
                    help="the folder holding MegaTrain's infinity/ package")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", default="results")
    return ap.parse_args()


def register_causal_sdpa() -> str:
    """Register ``causal_sdpa`` with transformers' attention interface (module doc)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("causal_sdpa", causal_sdpa)
    return "causal_sdpa"


def build_model(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers,
                      intermediate_size=a.intermediate, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                      max_position_embeddings=max(a.seq, 2048), tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16,
                                         attn_implementation=register_causal_sdpa())


def make_optimizer(params, lr: float):
    """DeepSpeed's CPU Adam where importable (MegaTrain's loop prefers it), else torch AdamW."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, adamw_mode=True), "deepspeed_cpu_adam"
    except Exception as exc:  # noqa: BLE001 - any failure to build the op: the fallback
        print(f"DeepSpeed CPU Adam unavailable ({exc}); torch AdamW", file=sys.stderr)
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01), "torch_adamw"


class PeakRss:
    """Host RSS sampled every 0.2 s on a thread (the peak of the whole run)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        proc = psutil.Process()
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def main() -> None:
    a = _args()
    sys.path.insert(0, str(a.megatrain_dir.resolve()))
    from infinity import CPUMasterModel
    from infinity.config import CPUMasterConfig

    rss = PeakRss()
    t0 = time.perf_counter()
    hf_model = build_model(a)
    config = CPUMasterConfig(model_name="random-init", dataset_path="random-token-ids",
                             attn_implementation="sdpa", max_seq_len=a.seq,
                             batch_size=a.micro_batch, num_steps=a.steps, learning_rate=a.lr,
                             weight_decay=0.01, checkpoint_interval=4, num_grad_slabs=12,
                             device=0, dtype=torch.bfloat16, enable_timing=False)
    model = CPUMasterModel(hf_model, config)
    del hf_model
    params = model.get_parameters()
    n_params = sum(p.numel() for p in params)
    opt, opt_name = make_optimizer(params, a.lr)
    print(f"built {n_params / 1e9:.3f} B params in {time.perf_counter() - t0:.0f} s; {opt_name}",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=gen)
        mask = torch.ones_like(ids)
        start = time.perf_counter()
        loss, _, _ = model.forward_and_backward(ids, mask, ids.clone())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        model._sync_params_to_gpu()
        model.zero_grad()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        print(f"step {i + 1} {times[-1]:.2f} s loss {losses[-1]:.3f}", flush=True)
    host_peak = rss.stop()
    s_step = statistics.median(times[a.warmup:] or times)
    tokens_s = a.micro_batch * a.seq / s_step
    result = {
        "contender": "megatrain", "optimizer": opt_name, "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": provenance.commit(), "params": n_params,
        "model": {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "heads",
                                             "kv_heads", "vocab", "seq", "micro_batch")},
        "steps": a.steps, "warmup": a.warmup, "s_per_step": s_step, "step_times": times,
        "tokens_per_s": tokens_s, "model_tflops": 6 * n_params * tokens_s / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_host_rss_gib": host_peak / 2**30, "losses": losses,
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"megatrain-mb{a.micro_batch}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"megatrain: {n_params / 1e9:.3f} B, micro batch {a.micro_batch}: {s_step:.2f} s/step, "
          f"{tokens_s:.0f} tokens/s, {result['model_tflops']:.1f} model TFLOPS, peak GPU "
          f"{result['peak_gpu_gib']:.1f} GiB, host RSS {result['peak_host_rss_gib']:.1f} GiB; "
          f"wrote {path}", flush=True)
    os._exit(0)  # its grad worker thread is not a daemon we can stop cleanly


if __name__ == "__main__":
    main()
