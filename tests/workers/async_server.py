"""An asyncio inference-style server: FastAPI on uvicorn, one AsyncClient for
every request.

    python async_server.py BROKER_URL PORT

Prints ``ready`` once it serves.  Routes (all JSON):

* ``GET /ping``: answers at once (the event loop is free).
* ``GET /sum/{name}?timeout=&newer_than=``: get the tensor (waiting up to
  ``timeout`` s; ``inf``: forever), answer its version and blake2b digest.
* ``GET /wait/{name}?deadline=``: the same with ``timeout=None``, under
  ``asyncio.wait_for(..., deadline)``: 504 when the deadline cancels it.
* ``GET /hold/{name}``: ``get(timeout=None)``, cancelled when the HTTP client
  hangs up (the handler watches for the disconnect, as servers do).
* ``POST /prepare/{key}?mib=&seed=``: make ``mib`` MiB of seeded random
  bytes (in a thread), for ``/put``.
* ``POST /put/{name}?key=``: put what ``/prepare`` made; answers the version
  and how long the put took.
* ``GET /lag``: the longest the event loop was late (a 5 ms ticker) since the
  last ``/lag``.
* ``GET /stat``: the broker's accounting, through the same AsyncClient.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from tensordepot import AsyncClient, TensorNotFound

URL, PORT = sys.argv[1], int(sys.argv[2])
client = AsyncClient(URL, label="async-server")
lag = {"max": 0.0}
prepared: dict[str, Any] = {}
cancelled = {"n": 0}


async def ticker() -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(0.005)
        lag["max"] = max(lag["max"], loop.time() - t0 - 0.005)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with client:
        tick = asyncio.ensure_future(ticker())
        print("ready", flush=True)
        yield
        tick.cancel()


app = FastAPI(lifespan=lifespan)


def digest(t: Any) -> dict[str, Any]:
    return {"version": t.version, "digest": hashlib.blake2b(np.from_dlpack(t)).hexdigest()}


@app.get("/ping")
async def ping() -> dict[str, str]:
    return {"pong": "ok"}


@app.get("/sum/{name}")
async def checksum(name: str, timeout: float = 0.0, newer_than: int = 0) -> Any:
    try:
        t = await client.get(
            name, timeout=None if math.isinf(timeout) else timeout, newer_than=newer_than
        )
    except TensorNotFound as exc:
        return JSONResponse({"error": str(exc)}, status_code=404)
    return digest(t)


@app.get("/wait/{name}")
async def wait(name: str, deadline: float) -> Any:
    try:
        t = await asyncio.wait_for(client.get(name, timeout=None), deadline)
    except asyncio.TimeoutError:
        cancelled["n"] += 1
        return JSONResponse({"error": "deadline"}, status_code=504)
    return digest(t)


@app.get("/hold/{name}")
async def hold(name: str, request: Request) -> Any:
    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    get = asyncio.ensure_future(client.get(name, timeout=None))
    gone = asyncio.ensure_future(hung_up())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not get.done():
        get.cancel()  # nobody is listening any more
        cancelled["n"] += 1
        return JSONResponse({"error": "gone"}, status_code=499)
    gone.cancel()
    return digest(get.result())


def random_bytes(mib: int, seed: int) -> tuple[Any, str]:
    data = np.random.default_rng(seed).integers(0, 255, mib << 20, dtype=np.uint8)
    return data, hashlib.blake2b(data).hexdigest()


@app.post("/prepare/{key}")
async def prepare(key: str, mib: int, seed: int = 0) -> dict[str, str]:
    prepared[key], hexdigest = await asyncio.to_thread(random_bytes, mib, seed)
    return {"digest": hexdigest}


@app.post("/put/{name}")
async def put(name: str, key: str) -> dict[str, Any]:
    t0 = time.monotonic()
    version = await client.put(name, prepared[key])
    return {"version": version, "seconds": time.monotonic() - t0}


@app.get("/lag")
async def get_lag() -> dict[str, float]:
    worst, lag["max"] = lag["max"], 0.0
    return {"max": worst, "cancelled": cancelled["n"]}


@app.get("/stat")
async def stat() -> dict[str, Any]:
    return (await client.stat()).model_dump()


# Listening before the lifespan hook says "ready": connections wait in the backlog.
listener = socket.socket()
listener.bind(("127.0.0.1", PORT))
listener.listen(128)
server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
asyncio.run(server.serve(sockets=[listener]))
