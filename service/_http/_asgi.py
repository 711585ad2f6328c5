"""The ASGI door: one middleware in front of FastAPI.

It serves every route of the table through the gate (service/_http/_gate.py),
exactly as the fast lane does, and hands FastAPI only the API documents
(``/openapi.json``, ``/docs``, ``/redoc``), after the gate has admitted
them.  Requests reach it when the lane declines them (a pipelined request
behind a busy one, ``Expect: 100-continue``, HEAD, ``x-tensordepot-door:
asgi``) and from in-process clients such as Starlette's TestClient.
"""

from __future__ import annotations

import time
from typing import Any

from .._registry._waits import ClientGone
from ._gate import MARK, Gate
from ._handler import body_refused


async def _read_body(receive: Any, headers: dict[bytes, bytes]) -> bytes:
    """The whole body, or ``too_large`` as soon as it is over the limit,
    announced (Content-Length) or streamed (chunked)."""
    refused = body_refused(headers.get(b"content-length"))
    if refused is not None:
        raise refused
    chunks, seen = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # gone mid-body: nothing runs
            raise ClientGone("the client hung up before its request's body arrived")
        chunk = message.get("body", b"")
        seen += len(chunk)
        refused = body_refused(None, seen)
        if refused is not None:
            raise refused
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _hangup(receive: Any) -> None:
    """Resolves when the client closes the connection (the body has been read
    already, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class AsgiDoor:
    """Pure ASGI: every HTTP request through the gate; lifespan to the app."""

    def __init__(self, app: Any, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate, started = self.gate, time.perf_counter()
        method, path = scope["method"], scope["path"]
        headers: dict[bytes, bytes] = dict(reversed(scope["headers"]))
        r = None
        media = "application/json"
        try:
            adm = gate.admit(method, path, scope)
            r = adm.route
            if r.handler is None:  # an API document: FastAPI's own
                await self._documents(scope, receive, send, r, started)
                return
            media = r.media
            data = await _read_body(receive, headers)
            reply = gate.dispatch(
                adm,
                "GET" if method == "HEAD" else method,
                path,
                scope,
                headers,
                scope.get("query_string", b""),
                data,
                lambda: _hangup(receive),
            )
            gate.settle()  # before anything awaits: no other request sees it unsettled
            status, body = reply if isinstance(reply, tuple) else await reply
        except BaseException as exc:  # every error becomes an answer
            status, body = gate.failure(exc, method, path)
        out = [*gate.head(status, media)]
        if status != 204:
            out.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
        gate.observe(method, r, status, started)

    async def _documents(self, scope: Any, receive: Any, send: Any, r: Any, started: float) -> None:
        status = 500

        async def marked(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), MARK]
            await send(message)

        try:
            await self.app(scope, receive, marked)
        finally:
            self.gate.observe(scope["method"], r, status, started)
