"""The broker, in three parts below its app (``app.py``): ``_registry``
(names, versions, leases, sessions, memory), ``_http`` (the doors, the gate,
the routes) and ``_hosts`` (Arrow Flight and peers), with ``config``,
``_auth`` and ``_metrics`` between the registry and the doors.

The public names load on first use (PEP 562): the ``tensordepot`` command
(``tensordepot.cli``) reads ``config.Settings`` for its flags, and its client
commands (``ls``, ``rm``, ``stat``, ``wait``) must not pay for importing
FastAPI and uvicorn.
"""

from __future__ import annotations

import typing

from .._lazy import lazy_names as _lazy_names

if typing.TYPE_CHECKING:
    from ._registry._broker import Broker as Broker
    from .app import create_app as create_app
    from .config import Settings as Settings

__all__ = ["Broker", "Settings", "create_app"]

_HOMES = {"Broker": "._registry._broker", "Settings": ".config", "create_app": ".app"}

__getattr__, __dir__ = _lazy_names(__name__, _HOMES, globals())
