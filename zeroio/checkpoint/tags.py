"""Tag names, the folders zeroio writes beside a tag, and the commit that makes a new copy the tag.

[Note: re-saving a tag] A save never writes into the tag's folder. Rank 0 lays
out `<dir>/.zeroio-new.<tag>` (its group zarr.json, zeroio's marker, first),
every rank writes its pieces there, rank 0 writes the manifest there, and only
then commits:
- a new tag: one rename of the staging folder to `<dir>/<tag>`;
- an existing tag: renameat2(RENAME_EXCHANGE) swaps the two folders atomically,
  so `<dir>/<tag>` is at every instant either the complete old copy or the
  complete new one. Where the file system has no exchange, two renames:
  `<tag>` -> `.zeroio-old.<tag>`, staging -> `<tag>`. A crash between them
  leaves no `<tag>` folder; readers then take the complete copy beside it
  (`pending_copy`: the new one first) and the next save renames it into place.
`latest` is written after the commit, so it never names an incomplete copy;
the old copy is removed last. Loading never removes anything: the folders
beside a tag are ignored (or read, in the gap above) and cleaned by the next
save (`recover`), which assumes one saver per checkpoint directory at a time.

[Note: deleting only what zeroio wrote] A folder is removed only when its
group zarr.json carries zeroio's checkpoint marker, and then only the entries
of the checkpoint layout (manifest, metadata, done markers, chunk files, extent
files, the temp files of atomic writes), the manifest first so a half-removed
copy is never complete. Anything else found inside is left where it is and
named. Removing an extent that is a hard link of a swap file removes the
checkpoint's name only: the swap store's file is untouched.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from zeroio import jsonlimits
from zeroio.checkpoint import layout
from zeroio.errors import CheckpointError
from zeroio.io.files import exchange, fsync_dir, rename

STAGING_PREFIX = ".zeroio-new."
RETIRED_PREFIX = ".zeroio-old."
_TEMP_FILE = re.compile(r"^\..+\.tmp$")  # atomic_write_text's temp files
_ROOT_TEMP = re.compile(r"^\.latest\.[0-9a-f]{12}\.tmp$")  # `latest` before its rename
_MARKER_TEMP = re.compile(r"^\.zarr\.json\.[0-9a-f]+\.tmp$")  # the marker, before its rename
_CHUNK = re.compile(r"^[0-9]+$")
_DONE = re.compile(r"^rank-[0-9]+\.json$")
_ARRAY_FILES = re.compile(r"^zarr\.json$")
_TOP_FILES = re.compile(r"^(zarr|manifest)\.json$")


def check_tag(tag) -> str:
    """``tag`` when it can name a checkpoint folder, else a CheckpointError naming the rule."""
    rule = ("a checkpoint tag is one folder name of letters, digits, '_', '-' and '.', not "
            "starting with '.' (zeroio's own folders do) and not 'latest'")
    if not isinstance(tag, str):
        raise CheckpointError(f"checkpoint tag {tag!r} is a {type(tag).__name__}, not a string: {rule}")
    if not layout.valid_name(tag) or tag == layout.LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} is not allowed: {rule}")
    return tag


def staging_dir(root: Path, tag: str) -> Path:
    return Path(root) / f"{STAGING_PREFIX}{tag}"


def retired_dir(root: Path, tag: str) -> Path:
    return Path(root) / f"{RETIRED_PREFIX}{tag}"


def side_folders(root: Path) -> dict[str, list[Path]]:
    """zeroio's folders beside tags (staging and retired copies), by the tag they belong to."""
    out: dict[str, list[Path]] = {}
    if not Path(root).is_dir():
        return out
    for d in sorted(Path(root).iterdir()):
        for prefix in (STAGING_PREFIX, RETIRED_PREFIX):
            tag = d.name[len(prefix):]
            if d.name.startswith(prefix) and layout.valid_name(tag) and not d.is_symlink():
                out.setdefault(tag, []).append(d)
    return out


def owned(path: Path) -> bool:
    """True when ``path`` is a folder whose group zarr.json carries zeroio's checkpoint marker."""
    try:
        doc = jsonlimits.loads((Path(path) / "zarr.json").read_text(encoding="utf-8"),
                               f"{path}/zarr.json")
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        return False
    attrs = doc.get("attributes")
    mark = attrs.get("zeroio") if isinstance(attrs, dict) else None
    return isinstance(mark, dict) and mark.get("format") == layout.FORMAT


def pending_copy(root: Path, tag: str) -> Path | None:
    """The complete copy beside ``tag`` to read when ``<root>/<tag>`` is missing (a crash
    between the two renames of a commit without exchange): the new one, else the old one."""
    if os.path.lexists(Path(root) / tag):
        return None
    for d in (staging_dir(root, tag), retired_dir(root, tag)):
        if d.is_dir() and not d.is_symlink() and owned(d) and _complete(d):
            return d
    return None


def _complete(d: Path) -> bool:
    try:
        layout.read_manifest(d / layout.MANIFEST)
    except CheckpointError:
        return False
    return True


def _remove_known(d: Path, files: re.Pattern) -> None:
    """Unlink the regular files of ``d`` whose names match ``files`` (or are temp files)."""
    for p in sorted(d.iterdir()):
        if p.is_file() and not p.is_symlink() and (files.match(p.name) or _TEMP_FILE.match(p.name)):
            p.unlink()


def _rmdir_if_empty(d: Path) -> None:
    if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
        d.rmdir()


def remove_owned(path: Path) -> list[Path]:
    """Remove a checkpoint copy zeroio wrote ([Note: deleting only what zeroio wrote]);
    returns what was left because zeroio did not write it. A folder without the marker is a
    CheckpointError, unless it is empty or holds only the marker's temp file."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()  # the link, never what it points at
        return []
    if not path.exists():
        return []
    if not path.is_dir() or not owned(path):
        # empty (a removal killed after the marker went), or a staging folder killed before its
        # marker was renamed in: it holds nothing else
        if path.is_dir() and all(path.name.startswith(STAGING_PREFIX) and p.is_file() and not p.is_symlink()
                                 and _MARKER_TEMP.match(p.name) for p in path.iterdir()):
            for p in path.iterdir():
                p.unlink()
            path.rmdir()
            return []
        raise CheckpointError(
            f"{path} is not a zeroio checkpoint (no zarr.json with zeroio's marker); zeroio does "
            "not delete what it did not write: move it away or save under another tag")
    if (path / layout.MANIFEST).exists():  # unpublish first: a half-removed copy is never complete
        (path / layout.MANIFEST).unlink()
        fsync_dir(path)
    for sub in sorted(path.iterdir()):
        if sub.is_symlink() or not sub.is_dir():
            continue
        if sub.name == layout.DONE_DIR:
            _remove_known(sub, _DONE)
        elif layout.valid_name(sub.name):  # an array: <kind>/zarr.json, <kind>/c/<i> or x/r<R>-<N>
            for folder, names in (("c", _CHUNK), (layout.EXTENTS_DIR, layout.EXTENT_RE)):
                files = sub / folder
                if files.is_dir() and not files.is_symlink():
                    _remove_known(files, names)  # an extent's name, never a linked swap file's
                    _rmdir_if_empty(files)
            _remove_known(sub, _ARRAY_FILES)
        _rmdir_if_empty(sub)
    rest = [p for p in path.iterdir()
            if p.is_symlink() or not p.is_file() or not (_TOP_FILES.match(p.name) or _TEMP_FILE.match(p.name))]
    if rest:  # keep the marker: the folder stays zeroio's, to be removed once they are moved out
        return sorted({f for p in rest for f in ([p] if p.is_file() or p.is_symlink() else p.rglob("*"))
                       if f.is_file() or f.is_symlink()} or set(rest))
    _remove_known(path, _TOP_FILES)  # the marker (group zarr.json) goes last
    _rmdir_if_empty(path)
    return []


def recover(root: Path, tags: list[str] | None = None) -> None:
    """Finish or undo what a crashed save left beside its tag ([Note: re-saving a tag]):
    a complete copy standing in for a missing tag folder is renamed into place, every
    other staging or retired copy is removed, and so is a temp file of `latest`. Rank 0, at
    the start of a save."""
    root = Path(root)
    for p in root.iterdir():
        if _ROOT_TEMP.match(p.name) and p.is_file() and not p.is_symlink():
            p.unlink()
    for tag, folders in side_folders(root).items():
        if tags is not None and tag not in tags:
            continue
        keep = pending_copy(root, tag)
        if keep is not None:
            rename(keep, root / tag)
            fsync_dir(root)
        for d in folders:
            if d != keep:
                try:
                    discard(d)
                except CheckpointError as e:  # not provably zeroio's: left alone
                    warnings.warn(str(e), layout.CheckpointWarning, stacklevel=2)


def discard(d: Path) -> None:
    """Remove a copy beside a tag; what zeroio did not write stays, with a warning."""
    kept = remove_owned(d)
    if kept:
        warnings.warn(f"{d}: left in place because zeroio did not write "
                      f"{[str(p) for p in kept[:5]]}; move them out and remove the folder",
                      layout.CheckpointWarning, stacklevel=3)


def check_replaceable(final: Path) -> None:
    """Before a save touches anything: an existing ``final`` must be a copy zeroio wrote."""
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir() or not owned(final)):
        raise CheckpointError(
            f"{final} exists and is not a zeroio checkpoint (no zarr.json with zeroio's marker); "
            "zeroio replaces only checkpoints it wrote: move it away or save under another tag")


def commit(staging: Path, final: Path) -> Path | None:
    """Make the complete copy in ``staging`` the tag ``final``; returns the folder that now
    holds the previous copy (to remove once `latest` is written), or None for a new tag."""
    root = final.parent
    if not os.path.lexists(final):
        rename(staging, final)
        fsync_dir(root)
        return None
    if exchange(staging, final):
        fsync_dir(root)
        return staging
    old = retired_dir(root, final.name)
    rename(final, old)
    fsync_dir(root)
    rename(staging, final)
    fsync_dir(root)
    return old


@dataclass(frozen=True, kw_only=True)
class TagStatus:
    """A tag found in a checkpoint directory."""

    tag: str
    path: Path  # the folder holding it (a copy beside the tag when the tag folder is missing)
    complete: bool
    reason: str  # "" when complete; why not otherwise
    created_unix: float


def _group_problem(d: Path) -> str | None:
    """None when ``d``'s group zarr.json carries zeroio's marker, else what is wrong with it."""
    meta = d / "zarr.json"
    if not meta.is_file():
        return f"its group metadata {meta} is missing"
    if not owned(d):
        return (f"its group metadata {meta} is damaged (not JSON with zeroio's marker); restore it, "
                "or load another tag")
    return None


def tag_status(d: Path, tag: str) -> TagStatus | None:
    """What the folder ``d`` holds as tag ``tag``; None when it is no zeroio checkpoint at all."""
    man = d / layout.MANIFEST
    has_group = (d / "zarr.json").is_file()
    if not has_group and not os.path.lexists(man):
        return None
    problem = _group_problem(d)
    if problem is not None and not os.path.lexists(man):
        try:  # another tool's zarr group: not ours, not reported
            jsonlimits.loads((d / "zarr.json").read_text(encoding="utf-8"), f"{d}/zarr.json")
            return None
        except (OSError, ValueError):
            pass
    mtime = d.stat().st_mtime
    if problem is not None:
        return TagStatus(tag=tag, path=d, complete=False, reason=problem, created_unix=mtime)
    if not os.path.lexists(man):
        done = len(list((d / layout.DONE_DIR).glob("rank-*.json"))) if (d / layout.DONE_DIR).is_dir() else 0
        return TagStatus(tag=tag, path=d, complete=False, created_unix=mtime,
                         reason=f"no {layout.MANIFEST}: the save was interrupted ({done} rank(s) had finished)")
    try:
        m = layout.read_manifest(man)
    except CheckpointError as e:
        return TagStatus(tag=tag, path=d, complete=False, reason=str(e), created_unix=mtime)
    return TagStatus(tag=tag, path=d, complete=True, reason="", created_unix=m.created_unix)


def scan_tags(root: str | os.PathLike) -> list[TagStatus]:
    """Every tag under ``root``, oldest first; incomplete and damaged ones included (with why).
    zeroio's folders beside tags are not tags, except a complete copy standing in for a missing
    tag folder (`pending_copy`)."""
    root = Path(root)
    found: list[TagStatus] = []
    if not root.is_dir():
        return found
    for d in root.iterdir():
        if d.name.startswith(".") or not d.is_dir():
            continue
        st = tag_status(d, d.name)
        if st is not None:
            found.append(st)
    for tag in side_folders(root):
        copy = pending_copy(root, tag)
        if copy is not None:
            found.append(tag_status(copy, tag))
    found.sort(key=lambda s: (s.created_unix, s.tag))
    return found


def is_tag_folder(path: Path) -> bool:
    """True when ``path`` looks like one tag's folder (what `inspect` / `consolidate` were given
    instead of the checkpoint directory above it)."""
    path = Path(path)
    return path.is_dir() and (owned(path) or (path / layout.MANIFEST).is_file())
