"""``steps_per_print``: one stderr line per N optimizer steps on rank 0, none by default.

Checked against the engine's own public numbers taken beside it: the lr and loss
scale after the printed step, and the bytes moved per tier pair between two lines
as the difference of ``engine.stats()["bytes_moved"]`` (a stage 3 run with
parameters and optimizer state on NVMe, so NVMe traffic is real).
"""

from __future__ import annotations

import contextlib
import io
import os
import re

from zeroio.testing import run_ranks

VOCAB, WIDTH, SEQ, MICRO = 64, 32, 8, 2


def _gb(n: int) -> str:  # the unit the line uses (engine._gb)
    return f"{n / 1e9:.2f}GB" if n >= 1e7 else f"{n / 1e6:.2f}MB"


def _body(every, nvme_dir, steps):
    import torch
    from torch import nn

    import zeroio

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.out = nn.Linear(WIDTH, VOCAB)

        def forward(self, input_ids):
            logits = self.out(self.emb(input_ids))
            return nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                        "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {
               "stage": 3, "stage3_param_persistence_threshold": 0,
               "sub_group_size": 1024,  # pieces small enough to stream through the budget
               "offload_param": {"device": "nvme", "nvme_path": os.path.join(nvme_dir, "p")},
               "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(nvme_dir, "o")},
               # a host budget below the moments: they stream (read and written every step)
               "tiering": {"cpu_budget_bytes": 60000}}}
    if every is not None:
        cfg["steps_per_print"] = every
    err = io.StringIO()
    seen = {}
    with contextlib.redirect_stderr(err):
        engine, *_ = zeroio.initialize(model=Tiny(), config=cfg)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            engine.backward(engine(input_ids=ids))
            engine.step()
            st = engine.stats()
            seen[engine.global_steps] = {"lr": engine.get_lr(), "scale": st["loss_scale"],
                                         "moved": dict(st["bytes_moved"])}
        engine.close()
    return err.getvalue(), seen


def test_one_line_per_n_steps_with_lr_scale_rates_and_moved_bytes(tmp_path):
    text, seen = run_ranks(_body, 1, 2, str(tmp_path), 5)[0]
    lines = [ln for ln in text.splitlines() if ln.startswith("[zeroio] step")]
    assert [int(ln.split()[2]) for ln in lines] == [2, 4], text
    before: dict = {}
    for ln in lines:
        step = int(ln.split()[2])
        ref = seen[step]
        assert f" lr {ref['lr'][0]:.4g} " in ln, (ln, ref)
        assert f" loss_scale {ref['scale']:g} " in ln
        assert re.search(r"samples/s [\d,.]+ tokens/s [\d,]+ ", ln), ln
        moved = {k: v - before.get(k, 0) for k, v in ref["moved"].items()}
        for pair, n in moved.items():
            if n:
                assert f"{pair} {_gb(n)}" in ln, (pair, n, ln)
        if not any(moved.values()):
            assert ln.endswith("moved since the last line: no transfers"), ln
        before = ref["moved"]
    assert "nvme->cpu" in lines[0] and "cpu->nvme" in lines[0], lines[0]  # the moments stream


def test_default_is_silent(tmp_path):
    text, _ = run_ranks(_body, 1, None, str(tmp_path), 3)[0]
    assert "[zeroio]" not in text, text
