"""`zeroio train` end to end, in a shortened form of the default run (2 ranks, stage 3, NVMe offload).

One uninterrupted run and one run stopped half way and resumed; the resumed
run must retrace the uninterrupted one loss for loss, and both must leave a
checkpoint and a folder that plain transformers loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zeroio.cli.train.data import ByteTokenizer, ShardedOrder, TokenBlocks, builtin_corpus
from zeroio.testing.train_cli import run_train

pytestmark = pytest.mark.slow
ARGS = ["--steps", "8", "--seq-len", "64", "--micro-batch", "2", "--json"]


def _train(out: Path, *extra: str) -> dict:
    return run_train(out, [*ARGS, *extra], os.environ, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    full = _train(root / "full", "--save-every", "4")
    part = _train(root / "part", "--stop-after", "4")
    resumed = _train(root / "part", "--resume")
    return root, full, part, resumed


def test_default_shape_trains_with_falling_loss(runs):
    root, full, _, _ = runs
    assert full["world_size"] == 2 and full["stage"] == 3
    assert full["offload_param"] == "nvme" and full["offload_optimizer"] == "nvme"
    assert len(full["losses"]) == 8
    assert full["first_loss"] == full["losses"][0] and full["last_loss"] == full["losses"][-1]
    # byte-level start is ~ln(256) = 5.55; the tiny model must learn something in 8 steps
    assert full["first_loss"] == pytest.approx(5.55, abs=0.3)
    assert full["last_loss"] < full["first_loss"] - 0.5
    moved = full["bytes_moved"]
    # the optimizer's moments are homed on NVMe; they fit the host budget, so they stay cached
    # and are not written back while training (tests/test_nvme_path.py), and never read: they
    # start as zeros on a disk never written. The checkpoint saves write them (cpu->nvme).
    assert full["tier_budgets"]["nvme"] > 0 and moved.get("nvme->cpu", 0) == 0, moved
    ckpts = root / "full" / "checkpoints"
    assert (ckpts / "step4").is_dir() and (ckpts / "step8").is_dir()
    assert full["checkpoint"] == str(ckpts / "step8")


def _first_batch_loss(model, world_size=2, micro_batch=2, seq_len=64, seed=1234) -> float:
    """Mean over ranks of the step-1 loss, recomputed with plain transformers."""
    blocks = TokenBlocks(ByteTokenizer().encode(builtin_corpus()), seq_len)
    losses = []
    for rank in range(world_size):
        order = ShardedOrder(num_blocks=len(blocks), world_size=world_size, rank=rank,
                             micro_batch=micro_batch, seed=seed)
        batch = blocks.batch(order.indices(0))
        with torch.no_grad():
            losses.append(model(**batch).loss.item())
    return sum(losses) / len(losses)


def test_consolidated_model_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from zeroio.cli.train.presets import llama_config

    root, full, _, _ = runs
    model = AutoModelForCausalLM.from_pretrained(full["model_dir"])
    assert isinstance(model, LlamaForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == full["params"]
    # Hugging Face's init (std 0.02) starts a byte model at ~ln(256) (PyTorch's default init,
    # what zero.Init alone leaves, starts higher): the run's step 1 must match a plain model's
    torch.manual_seed(1234)
    fresh = _first_batch_loss(LlamaForCausalLM(llama_config("tiny")))
    assert full["first_loss"] == pytest.approx(fresh, abs=0.03)
    # the trained weights do clearly better on that same batch, recomputed by plain transformers
    assert _first_batch_loss(model) < full["first_loss"] - 0.5


def test_resume_continues_where_the_stopped_run_left_off(runs):
    from safetensors.torch import load_file

    root, full, part, resumed = runs
    assert part["end_step"] == 4 and part["model_dir"] is None
    assert (root / "part" / "checkpoints" / "step4").is_dir()
    assert resumed["start_step"] == 4 and resumed["end_step"] == 8
    assert len(resumed["losses"]) == 8
    assert resumed["losses"][:4] == part["losses"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    a = load_file(Path(full["model_dir"]) / "model.safetensors")
    b = load_file(Path(resumed["model_dir"]) / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
