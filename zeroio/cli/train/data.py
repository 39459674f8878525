"""Training data for `zeroio train`: bytes in, fixed-length token blocks out, one shard per rank.

[Note: resumable order] The order of blocks is a pure function of
``(seed, epoch)``: a seeded permutation of all block indices, cut to a multiple
of ``world_size * micro_batch`` and dealt out round-robin. A rank asks for the
batch of global micro-step ``k`` and gets the same answer before and after a
restart, so resuming needs only the step counter that the checkpoint already
holds. Ranks never share a block within an epoch (their index sets are
disjoint by construction), which is what data parallelism needs.

Tokenization is byte-level (UTF-8 bytes are the token ids, vocabulary 256):
nothing is downloaded and any text round-trips exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import resources
from pathlib import Path

import torch

from zeroio.errors import ConfigError

VOCAB_SIZE = 256
# Files read from a --data folder; anything else (images, checkpoints) is skipped.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JOIN = b"\n\n"
"""What joins the files of a --data folder (a blank line)."""


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int) -> torch.Tensor:
    # cached: every micro-step of an epoch reads the same permutation
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


class ByteTokenizer:
    """UTF-8 bytes as token ids. ``decode`` replaces bytes that are not valid UTF-8."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)

    def decode(self, ids) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [v for v in values if not 0 <= int(v) < VOCAB_SIZE]
        if bad:
            raise ValueError(f"token ids must be bytes (0..255); got {bad[:5]}")
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")


def builtin_corpus() -> bytes:
    """The small public-domain-style corpus shipped with the package (the default run's data)."""
    return resources.files("zeroio.cli.train").joinpath("corpus.txt").read_bytes()


def text_files(path: str | Path) -> list[Path]:
    """The files ``read_text`` reads for --data ``path``, in its order; a ConfigError naming
    the path when there are none, or one cannot be read."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ConfigError(
                f"--data folder {p} holds no text files (looked for {', '.join(TEXT_SUFFIXES)}); "
                "pass a text file or a folder of them",
                key="data",
            )
    else:
        why = "does not exist" if not p.exists() else "is neither a file nor a folder"
        raise ConfigError(f"--data path {p} {why}; pass a text file or folder", key="data")
    for f in files:
        if not os.access(f, os.R_OK):
            raise ConfigError(f"--data file {f} cannot be read by this process (permissions)",
                              key="data")
    return files


def text_tokens(path: str | Path | None) -> int:
    """How many tokens ``read_text(path)`` gives (one per byte), from the files' sizes alone:
    the input checks count sequences before anything is read or written."""
    if path is None:
        return len(builtin_corpus())
    files = text_files(path)
    return sum(f.stat().st_size for f in files) + len(JOIN) * (len(files) - 1)


def read_text(path: str | Path | None) -> bytes:
    """The raw bytes to train on: the built-in corpus, a file, or every text file under a folder.

    A folder's files are read in sorted path order and joined by a blank line,
    so the token stream (and with it the run) is the same on every machine.
    """
    if path is None:
        return builtin_corpus()
    data = JOIN.join(f.read_bytes() for f in text_files(path))
    if not data:
        raise ConfigError(f"--data {path} is empty; it needs some text to train on", key="data")
    return data


def check_volume(*, data: str | Path | None, seq_len: int, micro_batch: int,
                 world_size: int, micro_batch_from: str = "--micro-batch") -> int:
    """The sequences --data holds, when one optimizer micro-step of ``world_size`` ranks x
    ``micro_batch`` finds that many (what ``TokenBlocks`` and ``ShardedOrder`` need); else a
    ConfigError naming --data (an empty file or folder too), --seq-len or where the micro
    batch came from (``micro_batch_from``)."""
    tokens = text_tokens(data)
    what = f"--data {data}" if data is not None else "the built-in corpus"
    if tokens == 0:
        raise ConfigError(f"{what} is empty; it needs some text to train on", key="data")
    blocks = tokens // seq_len
    if blocks == 0:
        raise ConfigError(f"{what} holds {tokens} tokens, fewer than one sequence of --seq-len "
                          f"{seq_len}; give more text or a shorter --seq-len", key="seq_len")
    need = world_size * micro_batch
    if blocks < need:
        raise ConfigError(f"{what} holds {blocks} sequences of --seq-len {seq_len} but one "
                          f"step over {world_size} rank(s) with micro batch {micro_batch:,} "
                          f"({micro_batch_from}) needs {need:,}; give more text or use a smaller "
                          "--seq-len or micro batch", key="data")
    return blocks


class TokenBlocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of ``seq_len`` tokens cut from one token stream (tail dropped).

    Each item is ``{"input_ids", "labels"}`` with ``labels == input_ids``: Hugging Face
    causal-LM models shift labels themselves.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if seq_len < 2:
            raise ConfigError(f"--seq-len must be at least 2, got {seq_len}", key="seq_len")
        n = tokens.numel() // seq_len
        if n == 0:
            raise ConfigError(
                f"the data holds {tokens.numel()} tokens, fewer than one sequence of --seq-len "
                f"{seq_len}; give more text or a shorter --seq-len",
                key="seq_len",
            )
        self.seq_len = seq_len
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {"input_ids": block, "labels": block}

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        block = self.blocks[torch.as_tensor(indices, dtype=torch.long)]
        return {"input_ids": block, "labels": block}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedOrder:
    """Which blocks rank ``rank`` trains on at each global micro-step (see [Note: resumable order])."""

    num_blocks: int
    """Blocks in the dataset."""
    world_size: int
    """Data-parallel ranks sharing the blocks."""
    rank: int
    """This rank, 0 <= rank < world_size."""
    micro_batch: int
    """Blocks per rank per micro-step."""
    seed: int = 0
    """Seed of every epoch's permutation (epoch e uses seed + e)."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.micro_batch < 1:
            raise ConfigError(f"--micro-batch must be >= 1, got {self.micro_batch}", key="micro_batch")
        if self.steps_per_epoch == 0:
            need = self.world_size * self.micro_batch
            raise ConfigError(
                f"the data holds {self.num_blocks} sequences but one step over {self.world_size} "
                f"ranks with --micro-batch {self.micro_batch} needs {need}; give more text or use "
                "a smaller --seq-len / --micro-batch",
                key="data",
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // (self.world_size * self.micro_batch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return _permutation(self.num_blocks, self.seed + epoch)

    def indices(self, step: int) -> list[int]:
        """Block indices of this rank's micro-batch at global micro-step ``step`` (>= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        per_step = self.world_size * self.micro_batch
        chunk = perm[pos * per_step : (pos + 1) * per_step]
        return chunk[self.rank :: self.world_size].tolist()
