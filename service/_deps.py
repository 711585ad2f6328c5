"""What the routers share: who is calling, the one error body, idempotent
requests, and the ASGI middleware that guards every request.

Hot routes declare no FastAPI dependencies at all: solving them costs more
per request than the broker's own work (and a plain ``def`` dependency even
hops to a worker thread).  They take the ``Request`` and read the session
header directly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.responses import JSONResponse, Response

from .._errors import DepotError, InvalidRequest
from .._proto import (
    CANCEL_HEADER,
    MAX_BODY_BYTES,
    MAX_RELEASE_IDS,
    RELEASE_HEADER,
    REQUEST_HEADER,
    SERVER_HEADER,
    SESSION_HEADER,
)
from .._version import __version__
from ._broker import Broker, ClientGone
from ._sessions import Caller

SessionHeader = Annotated[str | None, Header(alias=SESSION_HEADER,
                                             description="the id from POST /v1/sessions")]
RequestHeader = Annotated[str | None, Header(alias=REQUEST_HEADER, max_length=64,
                                             description="a client-chosen id: a resend with the "
                                                         "same id gets the first answer")]


def caller_of(scope: Any) -> Caller:
    """Who sent this request: the authenticated principal when there is one,
    else the unix peer's uid; the pid only when the kernel reported it."""
    state = scope.get("state") or {}
    principal = state.get("principal")
    conn = state.get("connection")  # kept per connection: the same principal, the same caller
    if conn is not None:
        known = conn.get("caller")
        if known is not None and known[0] is principal:
            return known[1]  # type: ignore[no-any-return]
    cred = state.get("peercred")
    pid = cred[0] if cred else None
    if principal is not None:
        who = Caller(principal.id, pid)
    elif cred:
        who = Caller(f"uid:{cred[1]}", pid)
    else:
        who = Caller("tcp", None)
    if conn is not None:
        conn["caller"] = (principal, who)
    return who


def caller(request: Request) -> Caller:
    return caller_of(request.scope)


def broker_of(request: Request) -> Broker:
    """The broker behind this app.

    Routes call this instead of declaring ``Depends(get_broker)``: each
    sub-dependency costs FastAPI more per request than our whole handler, and
    the control plane's speed is the product (README, Benchmarks: B5)."""
    broker: Broker = request.app.state.broker
    return broker


def error_response(status: int, code: str, message: str) -> JSONResponse:
    """The one error body: ``{"error": {"code", "message"}}``."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def json_response(body: str | bytes) -> Response:
    return Response(body, media_type="application/json")


async def hangup(request: Request) -> None:
    """Resolves when the client closes the connection (the request body has
    been read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def once(request: Request, run: Callable[[], Awaitable[Response]]) -> Response:
    """Run a request that changes state at most once per request id.

    A client resends a request whose answer it did not get (a connection cut
    mid-response).  With the same ``x-tensordepot-request`` id in the same
    session, the resend gets the first answer, kept for the last few ids,
    instead of a second allocation, lease or publish.  An id replays only for
    the same method and path: reused on another route, it runs anew."""
    slot = once_key(broker_of(request), request.method, request.url.path,
                    request.headers.get(SESSION_HEADER), request.headers.get(REQUEST_HEADER),
                    caller(request).identity)
    first: list[Response] = []

    async def answer() -> tuple[int, bytes]:
        resp = await run()
        first.append(resp)
        return resp.status_code, bytes(resp.body)

    status, body = await run_once(slot, answer)
    if first:
        return first[0]
    return Response(body, status_code=status, media_type="application/json")


CANCELLED = (409, (
    b'{"error":{"code":"cancelled","message":"the client hung up or cancelled this request"}}'))


def error_body(code: str, message: str) -> bytes:
    """The bytes of ``error_response``'s body."""
    return json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False,
                      separators=(",", ":")).encode()


async def run_once(slot: tuple[Any, str] | None,
                   run: Callable[[], Awaitable[tuple[int, bytes]]]) -> tuple[int, bytes]:
    """``once`` for answers as (status, body): the first answer to a request id
    (``once_key``) is kept and replayed; a resend that arrives while the first
    attempt still runs waits for its answer.  Without a slot, a DepotError
    propagates as it would from any route."""
    if slot is None:
        try:
            return await run()
        except ClientGone:
            return CANCELLED
    s, key = slot
    while True:
        hit: tuple[int, bytes] | None = s.answers.get(key)
        if hit is not None:
            return hit
        running = s.running.get(key)
        if running is None:
            break
        await asyncio.shield(running)  # the first attempt is still running: wait for its answer
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    s.running[key] = done
    try:
        try:
            status, body = await run()
        except DepotError as exc:
            status, body = exc.status, error_body(exc.code, str(exc))
        except ClientGone:  # nobody got an answer: a resend runs again
            return CANCELLED
        s.remember(key, status, body)
        return status, body
    finally:
        s.running.pop(key, None)
        done.set_result(None)


def _ids(raw: bytes, what: str) -> list[bytes]:
    ids = [x.strip() for x in raw.split(b",") if x.strip()]
    if len(ids) > MAX_RELEASE_IDS:
        raise InvalidRequest(f"{what} carries {len(ids)} ids; at most {MAX_RELEASE_IDS} per "
                             "request")
    return ids


def release_riders(broker: Broker, sid: str, who: Caller, releases: bytes | None,
                   cancels: bytes | None) -> None:
    """Release the lease ids and cancel the request ids that ride on a
    request's headers (``x-tensordepot-release``, ``x-tensordepot-cancel``)."""
    lease_ids = []
    for x in _ids(releases or b"", RELEASE_HEADER):
        if x.isdigit():
            lease_ids.append(int(x))
    requests = [x.decode("latin-1") for x in _ids(cancels or b"", CANCEL_HEADER)]
    broker.release(sid, who, lease_ids, requests)


def once_key(broker: Broker, method: str, path: str, sid: str | None, rid: str | None,
             identity: str) -> tuple[Any, str] | None:
    """(session, key) under which ``once`` keeps a request's answer, or None
    when the request carries no usable id (no session of this caller's, no id,
    or an id longer than 64 characters)."""
    s = broker.sessions.get(sid or "") if rid else None
    if s is None or rid is None or len(rid) > 64 or s.owner != identity:
        return None
    return s, f"{method} {path} {rid}"


class Guard:
    """ASGI middleware around every request:

    * refuses bodies over ``MAX_BODY_BYTES`` with 413, whether announced with
      Content-Length or streamed chunked;
    * releases the lease ids that ride on ``x-tensordepot-release`` and
      cancels the request ids on ``x-tensordepot-cancel`` (dropping tensors
      costs no round trip of its own); ids that are not the session's own are
      ignored."""

    _release = RELEASE_HEADER.encode()
    _cancel = CANCEL_HEADER.encode()
    _session = SESSION_HEADER.encode()

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            receive = self._check(scope, receive)
        except DepotError as exc:
            await error_response(exc.status, exc.code, str(exc))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Any, receive: Any) -> Any:
        releases = cancels = sid = None
        length = None
        for key, value in scope["headers"]:
            if key == self._release:
                releases = value
            elif key == self._cancel:
                cancels = value
            elif key == self._session:
                sid = value.decode("latin-1")
            elif key == b"content-length":
                length = value
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            raise _too_large()
        if (releases or cancels) and sid:
            # Starlette puts the app in the scope before middleware runs.
            broker: Broker | None = getattr(scope["app"].state, "broker", None)
            if broker is not None:
                release_riders(broker, sid, caller_of(scope), releases, cancels)  # 403: not yours
        if length is not None:
            return receive
        seen = 0

        async def counted() -> Any:  # a body without Content-Length (chunked)
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise _too_large()
            return message

        return counted


class MarkServer:
    """ASGI middleware, outermost: every response says it comes from a
    tensordepot broker (``x-tensordepot-broker: <version>``), errors of the
    layers inside included, so a client can tell a broker from any other
    HTTP server on the same URL."""

    _server = (SERVER_HEADER.encode(), __version__.encode())

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_marked(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._server]
            await send(message)

        await self.app(scope, receive, send_marked)


def _too_large() -> DepotError:
    exc = InvalidRequest(f"the request body is over {MAX_BODY_BYTES} bytes; send large tensors "
                         f"through /v1/alloc and shared memory, and batches in parts")
    exc.status, exc.code = 413, "too_large"
    return exc
