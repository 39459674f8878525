"""The folder an export (safetensors + config.json) is written into, and how it replaces an earlier one.

[Note: replacing an export] An export is written whole into a hidden staging
folder beside OUT (``.OUT.zeroio-export-<random>``, same file system) and only
then moved into place. Into a new OUT that is one rename. Into an existing OUT
(an earlier export, perhaps with the user's own files beside it: a tokenizer, a
README), the files an earlier export wrote are removed first, its entry points
(``model.safetensors``, ``model.safetensors.index.json``) before its shards, and
the new files come in with their entry point last. Only zeroio's export names are
removed (``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``, the index;
``config.json`` is replaced when the new export has one); every other file stays.
So ``from_pretrained(OUT)`` never loads the old weights beside the new ones (it
takes ``model.safetensors`` before an index), and at every instant OUT holds
either the old export, no loadable weights (a crash between the steps: loading
fails loudly), or the new export. A failed export removes its staging folder and
leaves OUT as it was. ``recover.py`` (standalone, no zeroio) does the same.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from zeroio.errors import CheckpointError
from zeroio.io.files import fsync_dir

EXPORT_FILE = re.compile(r"^(model\.safetensors|model\.safetensors\.index\.json|"
                         r"model-[0-9]{5}-of-[0-9]{5}\.safetensors)$")
ENTRY_POINTS = ("model.safetensors", "model.safetensors.index.json")


class ExportFolder:
    """A staging folder for an export to ``out``: write into ``path``, then ``publish``;
    leaving the ``with`` block without publishing removes it."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise CheckpointError(f"export folder {self.out} exists and is not a folder; pass a folder")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path = self.out.parent / f".{self.out.name}.zeroio-export-{secrets.token_hex(4)}"
        self.path.mkdir()

    def publish(self) -> list[Path]:
        """Move every file of the staging folder into ``out`` ([Note: replacing an export]);
        the paths in ``out``."""
        names = sorted(p.name for p in self.path.iterdir() if not p.name.startswith("."))
        if not self.out.exists():
            os.rename(self.path, self.out)
            fsync_dir(self.out.parent)
            return [self.out / n for n in names]
        old = sorted((p.name for p in self.out.iterdir() if EXPORT_FILE.fullmatch(p.name) and p.is_file()),
                     key=lambda n: n not in ENTRY_POINTS)
        for name in old:
            os.unlink(self.out / name)
        for name in [n for n in names if n not in ENTRY_POINTS] + [n for n in names if n in ENTRY_POINTS]:
            os.replace(self.path / name, self.out / name)
        fsync_dir(self.out)
        self.discard()
        return [self.out / n for n in names]

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> ExportFolder:
        return self

    def __exit__(self, *exc) -> None:
        if self.path.exists():
            self.discard()
