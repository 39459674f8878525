"""A DeepSpeed config dict as transformers/accelerate hand it over, made one zeroio reads.

accelerate's DeepSpeed plugin sets ``steps_per_print`` to ``float("inf")``
("never print", which DeepSpeed accepts and JSON cannot hold); zeroio's
``steps_per_print`` is an integer or absent, and absent means never, so the
infinite value is dropped. Every other key goes to zeroio's config layer as
given (an unknown one is its ``ConfigError``).
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
    return out
