"""A DeepSpeed config dict as transformers/accelerate hand it over, made one zeroio reads.

accelerate's DeepSpeed plugin sets ``steps_per_print`` to ``float("inf")``
("never print", which DeepSpeed accepts and JSON cannot hold); zeroio's
``steps_per_print`` is an integer or absent, and absent means never, so the
infinite value is dropped. Every other key goes to zeroio's config layer as
given (an unknown one is its ``ConfigError``), except dotted top-level keys:
TRL's ``prepare_deepspeed`` writes ``"zero_optimization.reduce_bucket_size"``
and two other bucket sizes as literal top-level keys (DeepSpeed ignores them);
the facade applies them where their names point, as integers.
"""

from __future__ import annotations

import copy
import math
from typing import Any


def for_zeroio(raw: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    spp = out.get("steps_per_print")
    if isinstance(spp, float) and math.isinf(spp):
        del out["steps_per_print"]
    for key in [k for k in out if isinstance(k, str) and "." in k]:
        value = out.pop(key)
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = int(value) if isinstance(value, float) and value.is_integer() else (
            int(round(value)) if isinstance(value, float) else value)
    return out
