"""Each package's ``__all__`` lists exactly its public names, sorted (as httpx checks)."""

from __future__ import annotations
import __future__

import importlib
import types

import pytest

PACKAGES = [
    "tensordepot",
    "tensordepot.checkpoint",
    "tensordepot.cli",
    "tensordepot.client",
    "tensordepot.service",
    "tensordepot.shm",
]


def public_names(module: types.ModuleType) -> list[str]:
    """Names a user would see: not private, not a submodule (importing
    ``tensordepot.client`` binds ``client`` on its parent), not a __future__ flag."""
    names = dir(module)  # a package that loads its names lazily (PEP 562) lists them in __dir__
    return [
        name
        for name in names
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(getattr(module, name), (types.ModuleType, __future__._Feature))
    ]


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps: CONSTANTS, then Classes, then the rest."""
    if len(name) > 1 and name.isupper():
        return 0, name
    return (1 if name[:1].isupper() else 2), name


@pytest.mark.parametrize("name", [pytest.param(p, id=p) for p in PACKAGES])
def test_all_matches_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported == sorted(exported, key=isort_key), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    assert sorted(exported) == sorted(public_names(module))
    missing = [attr for attr in exported if not hasattr(module, attr)]
    assert not missing, f"`from {name} import *` would fail on {missing}"


@pytest.mark.parametrize("name", [pytest.param(p, id=p) for p in PACKAGES])
def test_exports_live_in_private_modules(name: str) -> None:
    """Implementation lives in private modules (``_client.py``) and is
    re-exported; nothing public is defined in a package's ``__init__``."""
    module = importlib.import_module(name)
    for attr in module.__all__:
        home = getattr(getattr(module, attr), "__module__", None)
        if home is None:  # constants and instances carry no __module__
            continue
        assert home != name, f"{name}.{attr} is defined in __init__.py; move it to a private module"
        assert home.startswith("tensordepot."), (attr, home)
