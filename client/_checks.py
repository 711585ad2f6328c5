"""Argument checks at the API boundary: every bad input becomes a
``DepotError`` that names the argument, what was given and what is allowed.

Timeouts are validated here once (README, Lifetime: M6): ``None`` and
``inf`` wait forever, NaN and negative values are refused, and no value can
overflow a socket timeout or produce JSON that is not JSON.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from .._errors import InvalidRequest, InvalidType
from .._proto import MAX_WAIT
from .._wire import NAME_RULE as NAME_RULE
from .._wire import check_name as check_name
from .._wire import known_names


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to a sane length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_names(names: Any, one: str = "get()") -> list[str]:
    """A batch's names; ``one``: what takes a single name instead."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise InvalidType(
            f"names must be a list of tensor names, not {type(names).__name__} "
            f"{shown(names)}; for one name use {one}"
        )
    listed = list(names)
    if known_names(listed):
        return listed
    return [check_name(n, "each name") for n in listed]


def check_mapping(tensors: Any) -> Mapping[str, Any]:
    if not isinstance(tensors, Mapping):
        raise InvalidType(
            f"tensors must be a mapping of name -> tensor (a state dict), not "
            f"{type(tensors).__name__} {shown(tensors)}"
        )
    if not known_names(list(tensors)):
        for name in tensors:
            check_name(name, "each name")
    return tensors


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """Seconds to wait, or None for forever."""
    if timeout is None:
        return None
    if type(timeout) is float or type(timeout) is int:  # the common case, without the ABCs
        t = float(timeout)
        if 0 <= t <= MAX_WAIT:  # NaN is neither
            return t
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidType(
            f"{what} must be a number of seconds or None (wait forever), not "
            f"{type(timeout).__name__} {shown(timeout)}"
        )
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise InvalidRequest(f"{what} must be >= 0 seconds, or None to wait forever; got {t}")
    return None if t > MAX_WAIT else t


def check_ttl(ttl: Any) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
        raise InvalidType(
            f"ttl must be a number of seconds or None, not {type(ttl).__name__} {shown(ttl)}"
        )
    t = float(ttl)
    if not 0 < t < math.inf:
        raise InvalidRequest(f"ttl must be a finite number of seconds > 0, or None; got {t}")
    return t


def check_version(v: Any, what: str = "newer_than") -> int:
    """A version number >= 0; None is 0 (any version, the newest)."""
    if type(v) is int and v >= 0:  # the common case, without the ABCs
        return v
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidType(
            f"{what} must be an int version number, not {type(v).__name__} {shown(v)}"
        )
    if v < 0:
        raise InvalidRequest(f"{what} must be >= 0, got {v}")
    return int(v)


def check_shape(shape: Any) -> list[int]:
    try:
        dims = list(shape)
    except TypeError:
        raise InvalidType(
            f"shape must be a sequence of ints, not {type(shape).__name__} {shown(shape)}"
        ) from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise InvalidType(f"shape must hold ints, not {shown(d)} in {shown(shape)}")
        if d < 0:
            raise InvalidRequest(f"shape {shown(shape)} has a negative dimension")
    return [int(d) for d in dims]


def check_floors(newer_than: Any, names: list[str]) -> list[int] | None:
    """get_many's ``newer_than`` as one version per name, or None when it asks
    for nothing (0 everywhere)."""
    if isinstance(newer_than, Mapping):
        asked = set(names)
        if not asked.issuperset(newer_than):  # the usual map: the names' last versions
            for key in newer_than:
                if not isinstance(key, str):
                    raise InvalidType(
                        f"newer_than maps tensor names to versions; {shown(key)} is not a name"
                    )
            strays = [k for k in newer_than if k not in asked]
            raise InvalidRequest(
                f"newer_than names {len(strays)} tensor(s) that names does not: "
                f"{', '.join(map(repr, strays[:10]))}; give versions only for "
                f"the names asked for"
            )
        floors = list(map(newer_than.get, names, itertools.repeat(0)))
        if floors and not (set(map(type, floors)) == {int} and min(floors) >= 0):  # which not
            pairs = zip(names, floors, strict=True)
            floors = [check_version(v, f"newer_than[{n!r}]") for n, v in pairs]
    else:
        floors = [check_version(newer_than)] * len(names)
    return floors if any(floors) else None


def check_wait(wait: Any) -> Literal["all", "any"]:
    """get_many's ``wait``: "all" (every name newer) or "any" (one name newer)."""
    if wait == "all" and isinstance(wait, str):
        return "all"
    if wait == "any" and isinstance(wait, str):
        return "any"
    raise InvalidRequest(
        f"wait must be 'all' (until every name has a newer version) or "
        f"'any' (until one has), not {shown(wait)}"
    )
