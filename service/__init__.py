"""The broker: FastAPI app, registry of names, versions, leases and sessions.

The public names load on first use (PEP 562): the ``tensordepot`` command
lives in this package, and its client commands (``ls``, ``rm``, ``stat``,
``wait``) must not pay for importing FastAPI and uvicorn.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from ._broker import Broker as Broker
    from .app import create_app as create_app
    from .config import Settings as Settings

__all__ = ["Broker", "Settings", "create_app"]

_HOMES = {"Broker": "._broker", "Settings": ".config", "create_app": ".app"}


def __getattr__(name: str) -> typing.Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
