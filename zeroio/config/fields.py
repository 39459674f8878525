"""Typed fields for the config dataclasses, and the one builder that reads them.

Every config section is a frozen keyword-only dataclass whose fields carry a
``Spec`` in their metadata: how to check and coerce a JSON value, the legacy
names that map onto it. The dataclass default is the one home of the default
value; ``build`` never invents values, it only checks and converts what the
user wrote and leaves the rest to the dataclass.

[Note: strict JSON types]
JSON has one number type, and DeepSpeed users write integers as ``5e8``. An
int field therefore accepts an integral finite float (``2e8`` -> 200000000)
but not ``2.5``, not ``true`` (``bool`` is an ``int`` in Python) and not a
string: a value that only works by accident is a ConfigError, never a guess.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zeroio.errors import ConfigError

AUTO = "auto"
_MISSING = object()


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the nearest candidate, or '' when none is close."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "cpu"), shortened."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(path: str, value: Any, expected: str) -> ConfigError:
    if isinstance(value, str) and value == AUTO:
        return ConfigError(
            f'{path} is "auto", which zeroio cannot fill for this key: write {expected} instead',
            key=path,
        )
    return ConfigError(f"{path} = {show(value)}: expected {expected}", key=path)


# ----------------------------------------------------------------- coercers
# Each takes (value, key path) and returns the checked value or raises.

Coerce = Callable[[Any, str], Any]


def as_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise fail(path, value, "true or false")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_coercer(*, ge: int | None = None, gt: int | None = None, le: int | None = None,
                multiple_of: int | None = None, why: str = "") -> Coerce:
    """An integer within the bounds given; ``why`` (appended to the error) says what the
    bounds protect."""
    parts = [f">= {ge}" if ge is not None else f"> {gt}" if gt is not None else "",
             f"<= {le}" if le is not None else ""]
    bound = " " + " and ".join(p for p in parts if p) if any(parts) else ""
    if multiple_of is not None:
        bound += f", a multiple of {multiple_of}"

    def coerce(value: Any, path: str) -> int:
        if _number(value) and math.isfinite(value) and float(value).is_integer():
            out = int(value)
            if ((ge is None or out >= ge) and (gt is None or out > gt) and (le is None or out <= le)
                    and (multiple_of is None or out % multiple_of == 0)):
                return out
        raise fail(path, value, f"an integer{bound}{why}")

    return coerce


def float_coercer(*, ge: float | None = None, gt: float | None = None,
                  le: float | None = None) -> Coerce:
    parts = [f">= {ge}" if ge is not None else "", f"> {gt}" if gt is not None else "",
             f"<= {le}" if le is not None else ""]
    bound = " " + " and ".join(p for p in parts if p) if any(parts) else ""

    def coerce(value: Any, path: str) -> float:
        if _number(value) and math.isfinite(value):
            out = float(value)
            if ((ge is None or out >= ge) and (gt is None or out > gt)
                    and (le is None or out <= le)):
                return out
        raise fail(path, value, f"a finite number{bound}")

    return coerce


def optional(inner: Coerce) -> Coerce:
    def coerce(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return coerce


def as_str(value: Any, path: str) -> str:
    if isinstance(value, str) and value and value != AUTO:
        return value
    raise fail(path, value, "a non-empty string")


def enum_coercer(enum_cls: type[enum.Enum]) -> Coerce:
    names = [m.value for m in enum_cls]

    def coerce(value: Any, path: str) -> enum.Enum:
        if isinstance(value, str):
            for member in enum_cls:
                if member.value == value.lower():
                    return member
            hint = did_you_mean(value.lower(), names)
        else:
            hint = ""
        raise fail(path, value, "one of " + ", ".join(f'"{n}"' for n in names) + hint)

    return coerce


def section(cls: type) -> Coerce:
    """A nested section: a JSON object built into ``cls``."""

    def coerce(value: Any, path: str) -> Any:
        return build(cls, value, path)

    return coerce


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one config field is read. ``aliases``: legacy or alternative JSON names."""

    coerce: Coerce
    aliases: tuple[str, ...] = ()


def field(default: Any = _MISSING, *, coerce: Coerce, aliases: tuple[str, ...] = (),
          default_factory: Any = _MISSING) -> Any:
    meta = {"spec": Spec(coerce=coerce, aliases=aliases)}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def sub(cls: type) -> Any:
    """A nested section field whose default is ``cls()`` with all its defaults."""
    return field(coerce=section(cls), default_factory=cls)


def specs(cls: type) -> dict[str, Spec]:
    return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls) if "spec" in f.metadata}


# ------------------------------------------------------------------ builder

def build(cls: type, raw: Any, path: str) -> Any:
    """Build the dataclass ``cls`` from the JSON object ``raw`` found at ``path``.

    Unknown keys are errors with a "did you mean"; DeepSpeed keys that zeroio
    does not implement go through ``legacy.check_unimplemented``; a legacy
    alias and its current name both present with different values is an error.
    """
    from zeroio.config import legacy  # the tables import this module

    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise fail(path or "<config>", raw, "a JSON object")
    field_specs = specs(cls)
    alias_of = {a: name for name, s in field_specs.items() for a in s.aliases}
    kwargs: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{join(path, repr(key))}: config keys must be strings", key=path)
        name = alias_of.get(key, key)
        key_path = join(path, key)
        if name in field_specs:
            coerced = field_specs[name].coerce(value, key_path)
            if name in kwargs and kwargs[name] != coerced:
                raise ConfigError(
                    f"{join(path, written_as[name])} = {show(raw[written_as[name]])} and "
                    f"{key_path} = {show(value)} set the same option "
                    f"({join(path, name)}) to different values: keep one",
                    key=key_path,
                )
            kwargs[name] = coerced
            written_as[name] = key
        elif legacy.is_unimplemented(key_path):
            legacy.check_unimplemented(key_path, value)
        else:
            known = list(field_specs) + list(alias_of) + legacy.unimplemented_names(path)
            raise ConfigError(
                f"unknown config key {key_path}{did_you_mean(key, known)}", key=key_path
            )
    return cls(**kwargs)


def to_jsonable(value: Any) -> Any:
    """Dataclass trees, enums and tuples as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("json", True)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
