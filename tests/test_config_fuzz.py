"""Property: whatever JSON goes in, load_config returns a Config or raises ConfigError.

Two generators: arbitrary nested JSON objects, and configs built from the real
key paths (current names, legacy aliases, unimplemented DeepSpeed keys,
optimizer/scheduler params) with values of arbitrary JSON type, "auto"
included, plus arbitrary keyword arguments.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroio.config import Config, legacy, load_config
from zeroio.config.auto import AUTO_VALUE_CHECKS
from zeroio.config.fields import section, specs
from zeroio.config.loader import _Scalars
from zeroio.config.optim import _ADAM_PARAMS, _SCHEDULER_PARAMS, KNOWN_OPTIMIZERS
from zeroio.errors import ConfigError

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(
    max_size=8) | st.sampled_from(["auto", "cpu", "nvme", "none", "lru", "AdamW", "WarmupLR"])
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


def _known_paths() -> list[str]:
    paths: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, spec in specs(cls).items():
            path = f"{prefix}{name}"
            paths.append(path)
            paths.extend(f"{prefix}{a}" for a in spec.aliases)
            nested = [f for f in dataclasses.fields(cls) if f.name == name][0]
            if spec.coerce.__qualname__ == section(int).__qualname__ and callable(
                    nested.default_factory):
                walk(nested.default_factory, path + ".")

    walk(_Scalars, "")
    paths += list(legacy.SEMANTIC) + list(legacy.TOLERATED)
    paths += ["bfloat16", "allgather_size", "zero_optimization.cpu_offload",
              "zero_optimization.cpu_offload_param", "zero_optimization.cpu_offload_use_pin_memory",
              "optimizer.type", "scheduler.type"]
    paths += [f"optimizer.params.{k}" for k in _ADAM_PARAMS]
    paths += sorted({f"scheduler.params.{k}" for t in _SCHEDULER_PARAMS.values() for k in t})
    return sorted(set(paths))


KNOWN_PATHS = _known_paths()
VALUE_FOR_TYPE = {"optimizer.type": st.sampled_from(KNOWN_OPTIMIZERS) | json_values,
                  "scheduler.type": st.sampled_from(list(_SCHEDULER_PARAMS)) | json_values}


@st.composite
def configs_from_known_keys(draw) -> dict:
    out: dict = {}
    for path in draw(st.lists(st.sampled_from(KNOWN_PATHS), max_size=12, unique=True)):
        value = draw(VALUE_FOR_TYPE.get(path, json_values))
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


auto_values = st.dictionaries(
    st.sampled_from(sorted(AUTO_VALUE_CHECKS)) | st.text(max_size=6),
    st.integers(-3, 5000) | st.floats() | st.booleans() | st.none() | st.text(max_size=3),
    max_size=5)


def _check(raw, kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", legacy.ConfigWarning)
        try:
            cfg = load_config(raw, **kwargs)
        except ConfigError as e:
            assert str(e)
            return
    assert isinstance(cfg, Config)
    # A config that loads serialises to JSON and loads back to the same dict.
    d = cfg.to_dict()
    again = load_config(json.loads(json.dumps(d)), world_size=cfg.world_size)
    assert again.to_dict() == d


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(raw=st.dictionaries(st.text(max_size=10), json_values, max_size=6))
def test_arbitrary_json_only_raises_config_error(raw):
    _check(raw, {})


@SETTINGS
@given(raw=configs_from_known_keys(), kwargs=auto_values)
def test_known_keys_with_arbitrary_values_only_raise_config_error(raw, kwargs):
    _check(raw, kwargs)


@SETTINGS
@given(raw=json_values)
def test_non_object_top_level_only_raises_config_error(raw):
    _check(raw, {})
