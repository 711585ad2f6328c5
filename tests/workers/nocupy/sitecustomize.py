"""Put on PYTHONPATH, this makes ``import cupy`` fail in the process, as on a
machine where cupy is not installed (tests/e2e/test_no_cupy.py)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_BLOCKED = ("cupy", "cupyx", "cupy_backends")


class _NoCupy(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked for this test)", name=name
            )
        return None


sys.meta_path.insert(0, _NoCupy())
