"""Names of a package that load on first use (PEP 562), so that importing
the package does not import what they live in."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, homes: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``homes`` maps each lazy
    name to the module (relative to ``package``) that defines it.  A name,
    once loaded, is bound in ``namespace`` (the package's globals), so later
    lookups skip ``__getattr__``; ``__dir__`` lists the lazy names too."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
