"""A batch that grows mid-run: does resident optimizer state yield to training?

    # on the GPU machine (tools/device_batch.py growing-batch runs every row)
    python benchmarks/growing_batch.py --config configs/zero3-cpu.json --budget auto \
        --hidden 4096 --layers 20 --intermediate 11008 --heads 32 --seqs 1024,1024,1024,4096,4096

zeroio with CPU offload keeps host optimizer state resident on the GPU where training leaves
room ([Note: resident chunks] in zeroio/shard/assist.py); when a longer batch needs that room,
the GPU tier evicts it before the forward ([Note: resident state yields] in
zeroio/tiering/gpu_tier.py). One optimizer step per entry of ``--seqs`` at ``--micro-batch``
rows; per step: seconds, peak GPU memory (allocated and reserved, the allocator's peak reset
before each step), the resident bytes after it and the GPU tier's eviction counters. A step
that runs out of memory ends the run with ``"oom"`` in its row. One JSON file into ``--out``
(``growing-batch-<stage>-<budget>-<host>-<stamp>.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import provenance  # benchmarks/provenance.py
import torch
from train_llama import build_model, zeroio_config


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--budget", default="auto",
                    help="zero_optimization.tiering.gpu_budget_bytes: auto or a number of bytes")
    ap.add_argument("--seqs", default="1024,1024,1024,4096,4096",
                    help="sequence length of each optimizer step, comma separated")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    a.seq_list = [int(s) for s in a.seqs.split(",")]
    a.seq = max(a.seq_list)  # build_model: position embeddings
    a.accumulation, a.clip, a.stage, a.offload, a.nvme_path = 1, 1.0, None, None, None
    a.set = [] if a.budget == "auto" else [
        f"zero_optimization.tiering.gpu_budget_bytes={int(float(a.budget))}"]
    return a


def _step(engine, ids) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def main() -> None:
    a = _args()
    import zeroio

    cfg = zeroio_config(a)
    stage = cfg["zero_optimization"]["stage"]
    model = build_model(a, cfg if stage == 3 else None)
    engine, *_ = zeroio.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(0)
    cuda = engine.device.type == "cuda"  # a CPU run is a smoke test: no memory figures
    rows = []
    mark = time.perf_counter()
    for i, seq in enumerate(a.seq_list):
        ids = torch.randint(0, a.vocab, (a.micro_batch, seq), generator=gen).to(engine.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)
        row = {"step": i + 1, "seq": seq}
        try:
            row["loss"] = _step(engine, ids)
            if i == len(a.seq_list) - 1:
                engine.synchronize()  # the last step's host step belongs to it
            if cuda:
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as e:
            row["oom"] = str(e).splitlines()[0]
        now = time.perf_counter()
        tier = engine.gpu_tier.stats()
        gib = (lambda f: f(engine.device) / 2**30) if cuda else (lambda f: 0.0)
        row.update(s=now - mark, peak_gpu_gib=gib(torch.cuda.max_memory_allocated),
                   peak_reserved_gib=gib(torch.cuda.max_memory_reserved),
                   resident_gib=engine.gpu_tier.used_bytes / 2**30,
                   evictions=tier["evictions"], evicted_gib=tier["evicted_bytes"] / 2**30,
                   oom_retries=tier["oom_retries"])
        mark = now
        rows.append(row)
        print(f"step {row['step']} seq {seq}: {row['s']:.2f} s, peak {row['peak_gpu_gib']:.1f} "
              f"GiB (reserved {row['peak_reserved_gib']:.1f}), resident "
              f"{row['resident_gib']:.1f} GiB, evictions {row['evictions']}"
              + (f" OOM: {row['oom']}" if "oom" in row else ""), file=sys.stderr, flush=True)
        if "oom" in row:
            break
    result = {**provenance.header(), "config": a.config, "stage": stage, "budget": a.budget,
              "micro_batch": a.micro_batch, "seqs": a.seq_list,
              "model": {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "heads",
                                                   "vocab")},
              "params": sum(p.numel() for p in model.parameters()) if stage != 3 else None,
              "gpu": torch.cuda.get_device_name() if cuda else None, "steps": rows,
              "oom": any("oom" in r for r in rows), "gpu_tier": engine.gpu_tier.stats()}
    path = provenance.write_result(a.out, f"growing-batch-z{stage}-{a.budget}", result)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
