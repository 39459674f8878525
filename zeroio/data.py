"""The data order of ``initialize(training_data=...)``: seeded, sharded, resumable.

[Note: one global order]
Each epoch's order is a permutation of the dataset drawn from its own
generator seeded with ``seed + epoch`` (never from the global RNG, so model
code that consumes random numbers cannot shift it). Rank ``r`` of ``W`` takes
``perm[r::W]``, as ``torch.utils.data.DistributedSampler`` does. After every
rank has drawn ``k`` samples, exactly ``perm[:k*W]`` has been consumed, so the
position is one number, the global sample count, and a run resumed on any
world size continues with ``perm[g + r::W']``: no sample is seen twice or
skipped within the epoch. The engine counts ``global_samples`` and restores it
from checkpoints; ``load_checkpoint`` hands it to the sampler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Per-rank indices of a seeded global order that can restart at any global sample.

    Each ``iter()`` runs one epoch from the current position and then moves to
    the start of the next epoch (no ``set_epoch`` needed). Incomplete global
    batches at the end of an epoch are dropped so every rank sees the same
    number of samples.
    """

    def __init__(self, data: Sized, *, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.data_len = len(data)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0  # global samples already consumed in self.epoch

    @property
    def global_per_epoch(self) -> int:
        return self.data_len - self.data_len % self.num_replicas

    def __len__(self) -> int:
        return max(0, self.global_per_epoch - self.start) // self.num_replicas

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.data_len)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.data_len, generator=g)

    def resume(self, global_samples: int) -> None:
        """Continue after ``global_samples`` samples drawn over all ranks since the start."""
        per_epoch = self.global_per_epoch
        if per_epoch == 0:
            self.epoch, self.start = 0, 0
            return
        self.epoch, self.start = divmod(int(global_samples), per_epoch)
        # a position inside a global batch is not reachable by whole steps; round down
        self.start -= self.start % self.num_replicas

    def __iter__(self) -> Iterator[int]:
        perm = self.order(self.epoch)[: self.global_per_epoch]
        mine = perm[self.start + self.rank:: self.num_replicas].tolist()
        self.epoch, self.start = self.epoch + 1, 0
        return iter(mine)
