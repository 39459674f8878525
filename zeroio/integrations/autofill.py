"""Explicit config values that contradict the run's own arguments.

``load_config`` fills "auto" keys from TrainingArguments-style keyword values
(zeroio/config/auto.py holds the one table of which key takes which value).
This module applies the other half of Hugging Face's DeepSpeed rule: a key
that is *not* "auto" but set to a value different from what the arguments say
is an error, reported for every such key at once, never silent training on
one of the two values.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from zeroio.config.auto import _RULES, AUTO, check_auto_values
from zeroio.errors import ConfigError

# Keys whose explicit value is a choice of its own, not a second copy of an argument:
# TrainingArguments has no minimum LR, and bucket sizes merely default from the hidden size.
_NOT_COMPARED = {"scheduler.params.warmup_min_lr"} | {
    p for p, rule in _RULES.items() if rule.needs == ("hidden_size",)
}


def _lookup(raw: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def contradictions(raw: Mapping[str, Any], source: str = "TrainingArguments",
                   **values: Any) -> list[str]:
    """One line per explicit key of ``raw`` that disagrees with what ``values`` would fill."""
    checked = check_auto_values(values)
    lines = []
    for path, rule in _RULES.items():
        if path in _NOT_COMPARED or any(n not in checked for n in rule.needs):
            continue
        present, explicit = _lookup(raw, path)
        if not present or explicit == AUTO:
            continue
        expected = rule.value(checked)
        if not _same(explicit, expected):
            names = "/".join(rule.needs)
            lines.append(f"- {path} = {explicit!r} but {source} {names} gives {expected!r}")
    return lines


def check_no_contradictions(raw: Mapping[str, Any], source: str = "TrainingArguments",
                            **values: Any) -> None:
    """Raise ``ConfigError`` listing every contradiction (the first one's key as ``key``)."""
    lines = contradictions(raw, source, **values)
    if lines:
        first_key = lines[0][2:].split(" = ", 1)[0]
        raise ConfigError(
            f"the zeroio config contradicts {source}:\n" + "\n".join(lines)
            + f'\nset these keys to "auto" (filled from {source}) or make the two agree',
            key=first_key,
        )


def fill_known_autos(raw: Mapping[str, Any], **values: Any) -> dict[str, Any]:
    """A copy of ``raw`` with every "auto" that ``values`` determine filled; the others stay "auto".

    For a consumer that needs part of the config before all values are known
    (``zero.Init`` before the model, hence before ``hidden_size`` and the step count).
    """
    checked = check_auto_values(values)
    out = copy.deepcopy(dict(raw))
    for path, rule in _RULES.items():
        if any(n not in checked for n in rule.needs):
            continue
        *parents, leaf = path.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == AUTO:
            node[leaf] = rule.value(checked)
    return out
