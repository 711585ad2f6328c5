"""Takes each named tensor from a broker once, and says in one JSON line per
name what came of it: ``{"name", "raised": class name, "message"}``, with
``raised`` null after every byte of it was read (or written, for empty).
Then closes the client, which sends its releases, and exits 0.

    python handle_taker.py URL sync|async get|get_many|get_many_again|empty|put|put_many NAME...

``get_many_again``: a get_many of the name, every byte read and dropped, then another.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensordepot import AsyncClient, Client

URL, DRIVER, OP, *NAMES = sys.argv[1:]
BIG = np.ones(1 << 17, dtype=np.float32)  # 512 KiB: too large to go inline


def call(c: Any, name: str) -> Any:
    if OP == "get":
        return c.get(name)
    if OP in ("get_many", "get_many_again"):
        return c.get_many([name])
    if OP == "empty":
        return c.empty(name, (4,), "float32")
    if OP == "put":
        return c.put(name, BIG)
    return c.put_many({name: BIG})


def touch(got: Any) -> None:
    for t in got.values() if isinstance(got, Mapping) else [got]:
        if OP == "empty":
            np.from_dlpack(t)[...] = 1
        elif not isinstance(t, int):
            float(np.from_dlpack(t).sum())


def report(name: str, exc: BaseException | None) -> None:
    print(
        json.dumps(
            {
                "name": name,
                "raised": type(exc).__name__ if exc else None,
                "message": str(exc) if exc else None,
            }
        ),
        flush=True,
    )


async def take_all(c: Any) -> None:
    for name in NAMES:
        try:
            got = call(c, name)
            if OP == "get_many_again":
                first = await got if inspect.isawaitable(got) else got
                touch(first)
                del first
                got = c.get_many([name])
            touch(await got if inspect.isawaitable(got) else got)
        except Exception as exc:
            report(name, exc)
        else:
            report(name, None)


async def main() -> None:
    if DRIVER == "async":
        async with AsyncClient(URL) as c:
            await take_all(c)
    else:
        with Client(URL) as c:
            await take_all(c)


asyncio.run(main())
