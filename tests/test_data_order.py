"""The resumable data order of initialize(training_data=...): hand-checked, and across a checkpoint."""

import pytest
import torch

from zeroio.data import ResumableSampler
from zeroio.testing import run_ranks


def _perm(n, seed, epoch):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_take_strided_shares_of_one_seeded_order(world):
    n = 23
    samplers = [ResumableSampler(range(n), num_replicas=world, rank=r, seed=5) for r in range(world)]
    per_epoch = n - n % world
    for epoch in range(2):
        perm = _perm(n, 5, epoch)[:per_epoch]
        shares = [list(s) for s in samplers]
        for r, share in enumerate(shares):
            assert share == perm[r::world]
        assert sorted(i for sh in shares for i in sh) == sorted(perm)


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 2), (2, 1), (2, 3), (3, 2)])
def test_resume_on_any_world_size_continues_the_global_order(old_world, new_world):
    n, steps, micro = 40, 3, 2
    consumed = steps * micro * old_world  # global samples after 3 steps
    perm = _perm(n, 0, 0)
    new = [ResumableSampler(range(n), num_replicas=new_world, rank=r) for r in range(new_world)]
    for s in new:
        s.resume(consumed)
    rest = [list(s) for s in new]
    per_epoch = n - n % new_world
    start = consumed - consumed % new_world
    for r, share in enumerate(rest):
        assert share == perm[:per_epoch][start + r::new_world]
    seen_before = set(perm[:consumed])
    assert not seen_before & {i for sh in rest for i in sh}
    # the next epoch starts from its own permutation at 0
    assert list(new[0]) == _perm(n, 0, 1)[:per_epoch][0::new_world]


def test_resume_into_a_later_epoch():
    s = ResumableSampler(range(10), num_replicas=2, rank=1)
    s.resume(10 * 2 + 4)  # two whole epochs, then 4 samples
    assert (s.epoch, s.start) == (2, 4)
    assert list(s) == _perm(10, 0, 2)[4 + 1::2]


class _Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"idx": torch.tensor(i), "x": torch.randn(4, generator=g)}


def _train(engine, loader, steps):
    seen = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        seen.append(batch["idx"].tolist())
        loss = engine(batch["x"]).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return seen


def _rank_resume(tmp):
    import zeroio

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}}

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine, _, loader, _ = zeroio.initialize(model=model, config=cfg, training_data=_Indexed())
        return engine, loader

    engine, loader = fresh()
    straight = _train(engine, loader, 6)
    engine.close()
    engine, loader = fresh()
    first = _train(engine, loader, 3)
    engine.save_checkpoint(tmp, tag="t")
    engine.close()
    engine, loader = fresh()
    engine.load_checkpoint(tmp, tag="t")
    after = _train(engine, loader, 3)
    engine.close()
    return straight, first + after


def test_engine_dataloader_resumes_where_the_checkpoint_left_off(tmp_path):
    results = run_ranks(_rank_resume, 2, str(tmp_path))
    for straight, resumed in results:
        assert resumed == straight
    # the two ranks drew disjoint samples
    a = {i for step in results[0][0] for i in step}
    b = {i for step in results[1][0] for i in step}
    assert not a & b
