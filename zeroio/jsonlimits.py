"""The one JSON parser zeroio reads files with: bounded in size and depth.

[Note: bounded JSON]
Every JSON document zeroio reads (checkpoint manifests with the client state a user saved,
zarr metadata, configs, model configs) may come from anywhere. Python's parser recurses once
per level of nesting and raises ``RecursionError`` past about a thousand; the code that walks
the result (copies, dumps, checks) recurses too. So a document nested 100,000 deep would end
in a traceback far from the file, and one nested 900 deep would parse and fail later. Before
parsing, ``loads`` scans the text once (strings skipped, brackets counted, no recursion) and
refuses a document larger than ``max_bytes`` or nested deeper than ``max_depth`` with a
``JSONLimitError`` (a ``ValueError``) that names the document, the limit and where the text
crossed it; the caller adds its own error type and the fix. The limits are far above any
document zeroio writes (a manifest nests 6 levels; a Hugging Face config 4).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects accepted (a client_state deeper than this is refused)."""
MAX_BYTES = 256 << 20
"""Largest document accepted (a manifest of a 1e12-parameter model holds well under 1 MB)."""

_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{\]}]', re.DOTALL)


class JSONLimitError(ValueError):
    """A JSON document beyond ``MAX_BYTES`` or ``MAX_DEPTH`` (see [Note: bounded JSON])."""


def check_size(nbytes: int, what: str, *, max_bytes: int = MAX_BYTES) -> None:
    """``JSONLimitError`` when a document of ``nbytes`` is over ``max_bytes`` (a caller checks
    a file's size before it reads it)."""
    if nbytes > max_bytes:
        raise JSONLimitError(f"{what} is {nbytes} bytes, over the {max_bytes} bytes zeroio reads "
                             "as JSON")


def _check_depth(text: str, what: str, max_depth: int) -> None:
    depth = 0
    for m in _TOKENS.finditer(text):
        c = m.group()[0]
        if c in "[{":
            depth += 1
            if depth > max_depth:
                line = text.count("\n", 0, m.start()) + 1
                raise JSONLimitError(f"{what} is nested deeper than {max_depth} levels (line "
                                     f"{line}, character {m.start()}): not a document zeroio "
                                     "writes or reads")
        elif c in "]}":
            depth -= 1


def loads(text: str | bytes, what: str, *, max_depth: int = MAX_DEPTH,
          max_bytes: int = MAX_BYTES, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)`` within the limits ([Note: bounded JSON]). ``what`` names
    the document in errors ("checkpoint manifest /x/manifest.json"). Malformed JSON raises
    ``json.JSONDecodeError``, a limit ``JSONLimitError``: both ``ValueError``."""
    if isinstance(text, (bytes, bytearray)):
        check_size(len(text), what, max_bytes=max_bytes)
        text = bytes(text).decode("utf-8")
    check_size(len(text), what, max_bytes=max_bytes)
    _check_depth(text, what, max_depth)
    return json.loads(text, **kwargs)


__all__ = ["JSONLimitError", "MAX_BYTES", "MAX_DEPTH", "check_size", "loads"]
