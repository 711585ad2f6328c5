"""The broker's fast lane: its hottest requests answered inside the HTTP protocol.

A request served through ASGI costs the broker a task, a request-response
cycle, two socket writes (head, then body) and a walk through every
middleware and Starlette's router; on a machine where the broker, its
clients and their copies share two cores, that is most of a small get's
cost.  ``PeerCredProtocol`` (service/_server.py) therefore hands the routes
in ``Lane.ROUTES`` to this module as soon as their head is parsed, and the
answer goes out in one write, often before the protocol returns from
``data_received``:

* the same checks as the middleware stack, by the same code:
  ``AuthMiddleware.authorize`` (principal, scope, name prefix), the body
  limit and the piggybacked releases of ``Guard`` (``release_riders``),
  ``once`` (``run_once``: request ids replay their first answer), every
  answer marked with ``x-tensordepot-broker``, and every request timed
  into the same Prometheus histogram (``Metrics.observe_route``);
* the same handlers as the routes (the parameter checks of
  routers/tensors.py and routers/batch.py, the broker's methods), and the
  same error bodies (``DepotError`` -> its status and code);
* what can be answered at once is answered at once (``Broker.try_get``,
  ``try_put_inline``); what must wait (a get for a version not yet
  published, a put that needs a new segment) runs as a task, during which
  the connection counts as busy: a pipelined request behind it goes the
  ASGI way and waits its turn, as uvicorn queues any pipelined request.

Anything the lane does not take (other routes, HEAD, upgrades, ``Expect:
100-continue``, a connection with a response in flight) goes through ASGI
unchanged, where the same routes exist as plain Starlette routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import httptools
from pydantic import BaseModel, ValidationError

from .._errors import AuthError, DepotError, InvalidRequest
from .._proto import (
    CANCEL_HEADER,
    MAX_BODY_BYTES,
    RELEASE_HEADER,
    REQUEST_HEADER,
    SERVER_HEADER,
    SESSION_HEADER,
)
from .._version import __version__
from .._wire import BatchGet, ManyAlloc, ManyPublish, ReleaseRequest
from . import _many
from ._auth import AuthMiddleware, require_names
from ._broker import Broker
from ._deps import caller_of, error_body, once_key, release_riders, run_once
from ._metrics import Metrics
from .routers.tensors import get_params, put_params, tensor_name

if TYPE_CHECKING:
    from ._server import PeerCredProtocol

log = logging.getLogger("tensordepot.broker")

Answer = tuple[int, bytes]  # status, JSON body
_SESSION = SESSION_HEADER.encode()
_REQUEST = REQUEST_HEADER.encode()
_RELEASE = RELEASE_HEADER.encode()
_CANCEL = CANCEL_HEADER.encode()
_REASONS = {200: b"OK", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 409: b"Conflict", 413: b"Content Too Large",
            422: b"Unprocessable Content", 429: b"Too Many Requests", 500: b"Internal Server Error",
            503: b"Service Unavailable", 507: b"Insufficient Storage"}
_MARK = f"{SERVER_HEADER}: {__version__}\r\n".encode()


class LaneRequest:
    """One request the lane has taken, from its head to its answer."""

    __slots__ = ("body", "busy", "handler", "headers", "keep_alive", "method", "path", "query",
                 "scope", "started", "template", "too_large")

    def __init__(self, method: str, path: str, query: bytes, scope: dict[str, Any],
                 template: str, handler: Handler, keep_alive: bool) -> None:
        self.method, self.path, self.query, self.scope = method, path, query, scope
        self.template, self.handler, self.keep_alive = template, handler, keep_alive
        # Names are lower case; the first of repeated headers wins, as in Starlette's
        # request.headers.get() (Guard's piggybacked ids take the last, see _dispatch).
        self.headers: dict[bytes, bytes] = dict(reversed(scope["headers"]))
        self.body = bytearray()
        self.busy: _Busy | None = None  # set while the answer waits in a task
        self.too_large = False
        self.started = time.perf_counter()

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    def params(self) -> dict[str, str]:
        """The query string, as Starlette's ``request.query_params`` reads it
        (blank values kept; the last of repeated keys wins)."""
        q = self.query.decode("latin-1")
        if "%" in q or "+" in q:
            return dict(urllib.parse.parse_qsl(q, keep_blank_values=True))
        return {k: v for k, _, v in (p.partition("=") for p in q.split("&") if p)}


Handler = Callable[["Lane", LaneRequest], "Answer | Awaitable[Answer]"]


class _Lost:
    """``_Busy.message_event``: uvicorn calls ``set()`` when the connection is
    lost; ``future`` is what a parked get watches for a hang-up."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def set(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _Busy:
    """What ``PeerCredProtocol.cycle`` holds while a lane request waits: as
    uvicorn's own cycle, it makes later pipelined requests queue, learns of a
    hang-up (``disconnected``, ``message_event``) and of shutdown (``keep_alive``)."""

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = _Lost()


class Lane:
    """The fast lane of one app: its broker, its authorization and its metrics."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._auth = AuthMiddleware(None, app.state.auth_policy)
        self.metrics: Metrics = app.state.metrics

    _broker: Broker | None = None

    @property
    def broker(self) -> Broker:
        broker = self._broker
        if broker is None:  # made by the lifespan, after the app: kept once known
            broker = self._broker = self.app.state.broker
        return broker

    @staticmethod
    def match(method: str, path: str) -> tuple[str, Handler] | None:
        for (m, prefix, exact), (template, handler) in ROUTES:
            if m == method and (path == prefix if exact else path.startswith(prefix)):
                return template, handler
        return None

    # -- the protocol's hooks ----------------------------------------------------
    def take(self, proto: PeerCredProtocol) -> LaneRequest | None:
        """At the end of a request's head: a LaneRequest if the lane serves it."""
        parser = proto.parser
        if (proto.cycle is not None and not proto.cycle.response_complete) \
                or proto.expect_100_continue or parser.should_upgrade() \
                or proto.limit_concurrency is not None:
            return None
        method = parser.get_method().decode("ascii")
        url = httptools.parse_url(proto.url)
        path = url.path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)  # as uvicorn decodes the path it hands to ASGI
        found = self.match(method, path)
        if found is None:
            return None
        scope: dict[str, Any] = proto.scope  # type: ignore[assignment]
        scope["method"], scope["path"] = method, path
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive()
        return LaneRequest(method, path, url.query or b"", scope, found[0], found[1], keep_alive)

    def body(self, req: LaneRequest, chunk: bytes) -> None:
        if len(req.body) + len(chunk) > MAX_BODY_BYTES:
            req.too_large = True
        elif not req.too_large:
            req.body += chunk

    def run(self, proto: PeerCredProtocol, req: LaneRequest) -> None:
        """At the end of a request's body: answer it now, or start a task that will."""
        try:
            answer = self._dispatch(req)
        except BaseException as exc:  # every error becomes an answer
            answer = self._error(req, exc)
        if isinstance(answer, tuple):
            # A publish that woke parked gets answers first: its writer hears
            # back at once, and the gets' readers in the loop's next step.
            # (Measured on two shared cores, the other order made the whole
            # handoff slower: the reader's wake-up delays the writer's answer.)
            self._send(proto, req, answer)
            return
        busy = req.busy = _Busy(req.keep_alive)
        proto.cycle = busy  # type: ignore[assignment]

        async def finish(pending: Awaitable[Answer]) -> None:
            try:
                result = await pending
            except BaseException as exc:
                result = self._error(req, exc)
            busy.response_complete = True
            req.keep_alive = busy.keep_alive
            if not busy.disconnected:
                self._send(proto, req, result)

        task = proto.loop.create_task(finish(answer))
        task.add_done_callback(proto.tasks.discard)
        proto.tasks.add(task)

    # -- inside ------------------------------------------------------------------
    def _dispatch(self, req: LaneRequest) -> Answer | Awaitable[Answer]:
        scope = req.scope
        try:
            self._auth.authorize(scope)
        except AuthError as exc:
            return self._error(req, exc)
        if req.too_large:
            return 413, error_body("too_large", f"the request body is over {MAX_BODY_BYTES} bytes; "
                                   f"send large tensors through /v1/alloc and shared memory, and "
                                   f"batches in parts")
        releases = cancels = sid = None
        for key, value in scope["headers"]:  # as Guard reads them: the last of each wins
            if key == _RELEASE:
                releases = value
            elif key == _CANCEL:
                cancels = value
            elif key == _SESSION:
                sid = value.decode("latin-1")
        if (releases or cancels) and sid:
            release_riders(self.broker, sid, caller_of(scope), releases, cancels)
        return req.handler(self, req)

    def once(self, req: LaneRequest, run: Callable[[], Answer | None],
             later: Callable[[], Awaitable[Answer]]) -> Answer | Awaitable[Answer]:
        """``once`` for a lane request: a replayed answer, else ``run()`` now
        (None: it must wait), else ``later()`` as a task, under the request id."""
        slot = once_key(self.broker, req.method, req.path, req.header(_SESSION),
                        req.header(_REQUEST), caller_of(req.scope).identity)
        if slot is not None:
            s, key = slot
            hit: Answer | None = s.answers.get(key)
            if hit is not None:
                return hit
            if key in s.running:  # the first attempt still runs: wait for its answer
                return run_once(slot, later)
        try:
            answer = run()
        except DepotError as exc:
            if slot is None:
                raise
            answer = exc.status, error_body(exc.code, str(exc))
        if answer is None:
            return run_once(slot, later)
        if slot is not None:
            slot[0].remember(slot[1], *answer)
        return answer

    def _error(self, req: LaneRequest, exc: BaseException) -> Answer:
        if isinstance(exc, DepotError):
            return exc.status, error_body(exc.code, str(exc))
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        log.error("exception in %s %s", req.method, req.path, exc_info=exc)
        req.keep_alive = False
        return 500, b"Internal Server Error"

    def _send(self, proto: PeerCredProtocol, req: LaneRequest, answer: Answer) -> None:
        status, body = answer
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"")), _MARK]
        if status == 500:
            head.append(b"content-type: text/plain; charset=utf-8\r\n")
        elif status != 204:
            head.append(b"content-type: application/json\r\n")
        if status == 401:
            head.append(b"www-authenticate: Bearer\r\n")
        if status != 204:
            head.append(b"content-length: %d\r\n" % len(body))
        if not req.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        transport = proto.transport
        if not transport.is_closing():
            transport.write(b"".join(head) + body if status != 204 else b"".join(head))
        self.metrics.observe_route(req.method, req.template, status,
                                   time.perf_counter() - req.started)
        if not req.keep_alive:
            transport.close()
        else:
            proto.on_response_complete()


# -- the routes ----------------------------------------------------------------------


def handle_json(broker: Broker, v: Any, lease: int | None) -> bytes:
    """``broker.handle(v, lease)`` as JSON.  A published CPU version's handle
    never changes but for the lease: its JSON is made once, around the lease."""
    if v.state != "ready" or v.block.device != "cpu":
        return broker.handle(v, lease).model_dump_json().encode()
    wire = v.wire
    if wire is None:
        text = broker.handle(v, None).model_dump_json().encode()
        head, lease_null, tail = text.rpartition(b'"lease":null')
        assert lease_null, text
        wire = v.wire = (head + b'"lease":', tail)
    return b"%s%s%s" % (wire[0], b"null" if lease is None else b"%d" % lease, wire[1])


def _invalid(exc: ValidationError) -> InvalidRequest:
    """A body that does not validate, described as the app's handler describes it (422)."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where or 'request'}: {err.get('msg', 'invalid')}")
    out = InvalidRequest("invalid request: " + "; ".join(parts))
    out.status, out.code = 422, "invalid_request"
    return out


def _get_tensor(lane: Lane, req: LaneRequest) -> Answer | Awaitable[Answer]:
    """GET /v1/tensors/{name}: routers/tensors.py ``get_tensor``."""
    name = tensor_name(req.path[len("/v1/tensors/"):])
    wait, newer_than = get_params(req.params())
    broker = lane.broker
    sid, rid, who = req.header(_SESSION), req.header(_REQUEST), caller_of(req.scope)

    def now() -> Answer | None:
        got = broker.try_get(sid, who, name, newer_than, request=rid)
        return None if got is None else (200, handle_json(broker, *got))

    async def later() -> Answer:
        busy = req.busy
        lost = None
        if wait != 0 and broker._ready(name, newer_than) is None and busy is not None:
            lost = busy.message_event.future  # resolved when the client hangs up
        gone = None if lost is None else (lambda: lost)
        v, lease = await broker.get(sid, who, name, wait, newer_than, request=rid, gone=gone)
        return 200, handle_json(broker, v, lease)

    return lane.once(req, now, later)


def _put(lane: Lane, req: LaneRequest) -> Answer | Awaitable[Answer]:
    """POST /v1/put/{name}: routers/tensors.py ``put``."""
    areq = put_params(tensor_name(req.path[len("/v1/put/"):]), req.params(),
                      req.header(b"content-length") or "")
    broker = lane.broker
    sid, who, data = req.header(_SESSION), caller_of(req.scope), bytes(req.body)

    def now() -> Answer | None:
        v = broker.try_put_inline(sid, who, areq, data)
        return None if v is None else (200, handle_json(broker, v, None))

    async def later() -> Answer:
        return 200, handle_json(broker, await broker.put_inline(sid, who, areq, data), None)

    return lane.once(req, now, later)


def _release(lane: Lane, req: LaneRequest) -> Answer:
    """POST /v1/release: routers/tensors.py ``release``."""
    try:
        body = ReleaseRequest.model_validate_json(bytes(req.body) or b"null")
    except ValidationError as exc:
        raise _invalid(exc) from None
    n = lane.broker.release(req.header(_SESSION), caller_of(req.scope), body.leases, body.requests)
    return 200, b'{"released":%d}' % n


M = TypeVar("M", bound=BaseModel)


def _parse(req: LaneRequest, model: type[M]) -> M:
    """The JSON body as ``model``, its names checked against the principal's prefix."""
    try:
        body = model.model_validate_json(bytes(req.body) or b"null")
    except ValidationError as exc:
        raise _invalid(exc) from None
    require_names(req.scope["state"]["principal"], getattr(body, "names", ()))
    return body


def _many_alloc(lane: Lane, req: LaneRequest) -> Answer | Awaitable[Answer]:
    """POST /v1/many/alloc: routers/many.py ``alloc_many``."""
    body = _parse(req, ManyAlloc)
    broker, sid, who = lane.broker, req.header(_SESSION), caller_of(req.scope)
    rid = req.header(_REQUEST)

    def now() -> Answer | None:
        out = _many.alloc_now(broker, sid, who, body, rid)
        return None if out is None else (200, out)

    async def later() -> Answer:
        return 200, await _many.alloc(broker, sid, who, body, rid)

    return lane.once(req, now, later)


def _many_publish(lane: Lane, req: LaneRequest) -> Answer | Awaitable[Answer]:
    """POST /v1/many/publish: routers/many.py ``publish_many``."""
    body = _parse(req, ManyPublish)
    broker, sid, who = lane.broker, req.header(_SESSION), caller_of(req.scope)

    async def never() -> Answer:  # publishing never waits
        raise AssertionError("publish answered at once")

    return lane.once(req, lambda: (200, _many.publish(broker, sid, who, body)), never)


def _many_get(lane: Lane, req: LaneRequest) -> Answer | Awaitable[Answer]:
    """POST /v1/many/get: routers/many.py ``get_many``."""
    body = _parse(req, BatchGet)
    broker, sid, who = lane.broker, req.header(_SESSION), caller_of(req.scope)
    rid = req.header(_REQUEST)
    timeout = _many.wait_of(body)

    def now() -> Answer | None:
        out = _many.get_now(broker, sid, who, body, rid)
        return None if out is None else (200, out)

    async def later() -> Answer:
        busy = req.busy
        lost = None if timeout == 0 or busy is None else busy.message_event.future
        gone = None if lost is None else (lambda: lost)
        return 200, await _many.get(broker, sid, who, body, rid, timeout, gone)

    return lane.once(req, now, later)


# (method, path, exact: else a prefix) -> (the route's template, its handler), in match order.
ROUTES: list[tuple[tuple[str, str, bool], tuple[str, Handler]]] = [
    (("GET", "/v1/tensors/", False), ("/v1/tensors/{name}", _get_tensor)),
    (("POST", "/v1/put/", False), ("/v1/put/{name}", _put)),
    (("POST", "/v1/release", True), ("/v1/release", _release)),
    (("POST", "/v1/many/get", True), ("/v1/many/get", _many_get)),
    (("POST", "/v1/many/alloc", True), ("/v1/many/alloc", _many_alloc)),
    (("POST", "/v1/many/publish", True), ("/v1/many/publish", _many_publish)),
]
