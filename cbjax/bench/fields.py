"""Reading experiment config fields: a dict, an ml_collections ConfigDict or a plain object, by attribute or item,
with checks that name the field in their errors (so a typo in a config file fails before anything runs)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def get_field(cfg: Any, name: str, default: Any = None) -> Any:
    """Field `name` of `cfg` (mapping or object); a missing field or a None value gives `default`."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        value = cfg.get(name, None)
    else:
        try:
            value = getattr(cfg, name)
        except AttributeError:
            value = None
            if hasattr(cfg, "__getitem__"):
                try:
                    value = cfg[name]
                except (KeyError, IndexError, TypeError):
                    value = None
    return default if value is None else value


def field_names(cfg: Any) -> list[str] | None:
    if isinstance(cfg, Mapping) or callable(getattr(cfg, "keys", None)):
        return list(map(str, cfg.keys()))
    if hasattr(cfg, "__dict__"):
        return [k for k in vars(cfg) if not k.startswith("_")]
    return None


def check_fields(cfg: Any, allowed: Iterable[str], where: str) -> None:
    keys = field_names(cfg)
    if keys is None:
        return
    allowed = tuple(allowed)
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {sorted(allowed)}")


def as_int(value: Any, field: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if not isinstance(value, numbers.Integral) and (not math.isfinite(value) or value != int(value)):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


def as_float(value: Any, field: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{field} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return value


def as_choice(value: Any, field: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")
    return value
