"""Keeping the newest N tags of a checkpoint directory (``checkpoint.keep_last``).

[Note: keeping the newest N] After a save has committed its tag and written `latest`, the
rank that committed it (rank 0) removes the complete tags zeroio wrote beyond the newest N,
newest by the time their manifest was written, the way the Hugging Face Trainer rotates
``save_total_limit`` checkpoints after a save. Never removed:
- the tag `latest` names, nor the tag just saved (both are normally the newest);
- an incomplete tag (an interrupted save, a damaged manifest): it is not counted either, and
  stays for `zeroio inspect` and tools/recover.py;
- a folder zeroio did not write (no zarr.json with its marker): it is not a tag here.
Removal goes through ``tags.remove_owned`` ([Note: deleting only what zeroio wrote] in
tags.py): the manifest first, so a half-removed tag is never complete; a file someone put
inside a tag is left in place with a warning. The removal runs after the new tag is
committed, so the disk holds N + 1 tags while a save is written (the pre-flight of `zeroio
train` counts that peak), and a failed save removes nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from zeroio.checkpoint import layout, tags


def doomed_tags(root: str | Path, keep: int, *, saved: str | None = None) -> list[str]:
    """The tags ``prune_tags`` removes from ``root`` with ``keep`` ([Note: keeping the newest
    N]), oldest first; ``saved``: the tag just saved (kept whatever its time)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest tags kept), got {keep}")
    root = Path(root)
    complete = [t for t in tags.scan_tags(root) if t.complete and t.path == root / t.tag]
    newest = sorted(complete, key=lambda t: (t.created_unix, t.tag), reverse=True)
    spared = {t.tag for t in newest[:keep]} | {layout.read_latest(root), saved}
    return [t.tag for t in reversed(newest[keep:]) if t.tag not in spared]


def prune_tags(root: str | Path, keep: int, *, saved: str | None = None) -> list[str]:
    """Remove the complete tags zeroio wrote in ``root`` beyond the newest ``keep``; the tags
    removed whole, oldest first. One that cannot be removed whole (a foreign file inside it, an OS
    error) is named in a ``CheckpointWarning`` and kept: the save that asked succeeded."""
    removed = []
    for tag in doomed_tags(root, keep, saved=saved):
        path = Path(root) / tag
        try:
            left = tags.remove_owned(path)
        except (OSError, ValueError) as e:  # CheckpointError is a ValueError
            warnings.warn(f"checkpoint.keep_last: could not remove {path}: {e}",
                          layout.CheckpointWarning, stacklevel=2)
            continue
        if left:
            warnings.warn(f"checkpoint.keep_last: {path} is no longer a checkpoint, but holds "
                          f"files zeroio did not write ({[str(p) for p in left[:5]]}); move them "
                          "out and remove the folder", layout.CheckpointWarning, stacklevel=2)
            continue
        removed.append(tag)
    return removed
