"""Both clients, called one way: ``Api`` makes a ``Client``'s or an
``AsyncClient``'s calls alike, for tests that run through each."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from tensordepot import AsyncClient, Client


class Api:
    """One client's calls, made the same way for a Client and an AsyncClient
    (whose coroutines run to their end on a loop of its own)."""

    def __init__(self, url: str, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop() if kind == "async" else None
        self.c: Any = Client(url) if kind == "sync" else AsyncClient(url)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.c, name)
        if self.loop is None or not inspect.iscoroutinefunction(attr):
            return attr
        loop = self.loop
        return lambda *a, **kw: loop.run_until_complete(attr(*a, **kw))

    def close(self) -> None:
        if self.loop is None:
            self.c.close()
            return
        self.loop.run_until_complete(self.c.aclose())
        self.loop.close()
