"""The gate: everything that happens around a route's handler, for both doors.

The fast lane (service/_http/_lane.py) and the ASGI door (service/_http/_asgi.py) turn
bytes into a request and an answer back into bytes.  Everything between is
here, as plain function calls, in this order:

1. ``admit``: the route (``_routes.match``: 404, 405), the principal and the
   route's scope (``Authorizer``: 401, 403), the principal's prefix for the
   name in the path (403), and the name itself (``check_name``: 400).  Nothing else
   runs, and no body is buffered, for a request that is not admitted.
2. ``dispatch``: the release and cancel ids riding on the request's headers
   (``release_riders``), a request the client cancelled before it arrived
   (409: it came by another door, or waited in a lane's ring, after its
   cancel), the body parsed as the route's model (400, 422),
   the names in it checked against the prefix, then the handler, under its
   request id for routes that replay their first answer (``once``).  What
   the handler's publish retires waits until the door has written the
   answer and calls ``settle``, in the same step of the loop.
3. ``failure``: the one error serializer, ``{"error": {"code", "message"}}``.
4. ``head``: the one set of answer headers (the server mark, the content
   type, ``www-authenticate`` on 401), and ``observe``: the route metrics.

The body limit (413) is the doors' to enforce while they read, with the
one ``too_large`` error; the head limit (431) is the HTTP protocol's
(service/_http/_server.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..._errors import Cancelled, DepotError, InvalidRequest, MethodNotAllowed, NoRoute, error_body
from ..._proto import (
    CANCEL_HEADER,
    MAX_RELEASE_IDS,
    REASONS,
    RELEASE_HEADER,
    REQUEST_HEADER,
    SERVER_HEADER,
    SESSION_HEADER,
)
from ..._version import __version__
from ..._wire import check_name
from .._auth import READ, Authorizer, AuthPolicy, Principal, require_name, require_names
from .._metrics import UNMATCHED, Metrics
from .._registry._broker import Broker
from .._registry._sessions import Caller
from .._registry._waits import ClientGone
from ._handler import (
    HANDOVER,
    JSON,
    Answer,
    Call,
    Reply,
    Route,
    parse_body,
    parse_framed,
    parse_kept,
)
from ._routes import match

if TYPE_CHECKING:
    from .._registry._sessions import Session

log = logging.getLogger("tensordepot.broker")

_SESSION = SESSION_HEADER.encode()
_REQUEST = REQUEST_HEADER.encode()
_RELEASE = RELEASE_HEADER.encode()
_CANCEL = CANCEL_HEADER.encode()
CANCELLED: Answer = (
    Cancelled.status,
    error_body(Cancelled("the client hung up or cancelled this request")),
)
INTERNAL: Answer = (500, b"Internal Server Error")


class Admitted:
    """A request the gate let in: its route, path parameters and principal."""

    __slots__ = ("params", "principal", "route")

    def __init__(self, route: Route, params: dict[str, str], principal: Principal) -> None:
        self.route, self.params, self.principal = route, params, principal


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
        who = Caller(principal.id, pid, principal.prefix)
    elif cred:
        who = Caller(f"uid:{cred[1]}", pid)
    else:
        who = Caller("tcp", None)
    if conn is not None:
        conn["caller"] = (principal, who)
    return who


_QUERIES: dict[bytes, dict[str, str]] = {}  # short query strings seen lately, parsed


def query_of(raw: bytes) -> dict[str, str]:
    """A query string as Starlette's ``request.query_params`` reads it (blank
    values kept; the last of repeated keys wins).  Read-only: a short one is
    parsed once and shared (a client's gets send the same few, over and over)."""
    known = _QUERIES.get(raw)
    if known is not None:
        return known
    q = raw.decode("latin-1")
    if "%" in q or "+" in q:
        parsed = dict(urllib.parse.parse_qsl(q, keep_blank_values=True))
    else:
        parsed = {k: v for k, _, v in (p.partition("=") for p in q.split("&") if p)}
    if len(raw) <= 128:
        if len(_QUERIES) >= 1024:
            _QUERIES.clear()
        _QUERIES[raw] = parsed
    return parsed


def _names(body: Any) -> Iterator[str]:
    """Every tensor name a request body carries."""
    name = getattr(body, "name", None)
    if isinstance(name, str):
        yield name
    yield from getattr(body, "names", None) or ()
    prefix = getattr(body, "prefix", None)  # covers names only within the token's prefix
    if isinstance(prefix, str):
        yield prefix
    for item in getattr(body, "items", ()):
        yield item.name


def _ids(raw: bytes, what: str) -> list[bytes]:
    ids = [x.strip() for x in raw.split(b",") if x.strip()]
    if len(ids) > MAX_RELEASE_IDS:
        raise InvalidRequest(
            f"{what} carries {len(ids)} ids; at most {MAX_RELEASE_IDS} per request"
        )
    return ids


def release_riders(
    broker: Broker, sid: str, who: Caller, releases: bytes | None, cancels: bytes | None
) -> None:
    """Release the lease ids and cancel the request ids that ride on a
    request's headers (``x-tensordepot-release``, ``x-tensordepot-cancel``)."""
    lease_ids = [int(x) for x in _ids(releases, RELEASE_HEADER) if x.isdigit()] if releases else []
    requests = [x.decode("latin-1") for x in _ids(cancels, CANCEL_HEADER)] if cancels else []
    broker.release(sid, who, lease_ids, requests)


def once_key(
    broker: Broker, method: str, path: str, sid: str | None, rid: str | None, who: Caller
) -> tuple[Session, str] | None:
    """(session, key) under which a request's answer is kept, or None when
    the request carries no usable id (no session of this caller's, no id, or
    an id longer than 64 characters).  An id replays only for the same
    method and path: reused on another route, it runs anew."""
    s = broker.sessions.owned_by(sid, who) if rid else None
    if s is None or rid is None or len(rid) > 64:
        return None
    return s, f"{method} {path} {rid}"


async def run_once(
    slot: tuple[Session, str] | None, run: Callable[[], Awaitable[Answer]]
) -> Answer:
    """The first answer to a request id (``once_key``) is kept and replayed;
    a resend that arrives while the first attempt still runs waits for its
    answer.  Without a slot, a DepotError propagates."""
    if slot is None:
        try:
            return await run()
        except ClientGone:
            return CANCELLED
    s, key = slot
    while True:
        hit = s.answers.get(key)
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
            status, body = exc.status, error_body(exc)
        except ClientGone:  # nobody got an answer: a resend runs again
            return CANCELLED
        s.remember(key, status, body)
        return status, body
    finally:
        s.running.pop(key, None)
        done.set_result(None)


async def _awaited(reply: Reply) -> Answer:
    return reply if isinstance(reply, tuple) else await reply


MARK = (SERVER_HEADER.encode(), __version__.encode())


class Gate:
    """The gate of one app: its broker, its authorizer and its metrics."""

    def __init__(self, state: Any, policy: AuthPolicy, metrics: Metrics) -> None:
        self.state = state  # the app's state: the broker once the lifespan made it
        self.auth = Authorizer(policy)
        self.metrics = metrics
        self._heads: dict[tuple[int, str], list[tuple[bytes, bytes]]] = {}

    _broker: Broker | None = None

    @property
    def broker(self) -> Broker:
        broker = self._broker
        if broker is None:  # made by the lifespan, after the app: kept once known
            broker = self._broker = self.state.broker
        return broker

    # -- 1. admission ------------------------------------------------------------------
    def admit(self, method: str, path: str, scope: Any) -> Admitted:
        """The route, its parameters and the principal, or a DepotError."""
        r, params, other = match(method, path)
        if r is None:  # unknown routes need the read scope, then answer 404 (405)
            self.auth.authorize(scope, method, path, READ)
            raise (MethodNotAllowed if other else NoRoute)(
                f"{method} {path if len(path) <= 200 else path[:200] + '...'}: "
                + ("Method Not Allowed" if other else "Not Found")
            )
        principal = self.auth.authorize(scope, method, r.template, r.scope)
        name = params.get("name")
        if name is not None:  # outside the prefix is 403, whatever the name
            if principal.prefix is not None:
                require_name(principal, name)
            check_name(name, "tensor name")
        return Admitted(r, params, principal)

    # -- 2. the handler ------------------------------------------------------------------
    def dispatch(
        self,
        adm: Admitted,
        method: str,
        path: str,
        scope: Any,
        headers: dict[bytes, bytes],
        query: bytes,
        data: bytes,
        gone: Callable[[], Awaitable[Any]] | None,
    ) -> Reply:
        """Run the admitted request's riders and handler: an answer now, or an
        awaitable of one.  Raises DepotError for bad input.  What a publish
        retires waits for the answer (``Memory.retire_after``): the door
        calls ``settle`` as soon as the answer is written, and a request
        finds the books settled before it runs."""
        memory = self.broker.memory
        memory.retire_pending()
        memory.deferring = True  # the handler's own steps: an awaitable's run later
        try:
            r, broker, principal = adm.route, self.broker, adm.principal
            who = caller_of(scope)
            releases, cancels = headers.get(_RELEASE), headers.get(_CANCEL)
            sid = headers.get(_SESSION)
            if (releases or cancels) and sid:
                release_riders(broker, sid.decode("latin-1"), who, releases, cancels)
            rid = headers.get(_REQUEST)
            if rid and sid and broker.was_cancelled(sid.decode("latin-1"), rid.decode("latin-1")):
                raise Cancelled("the client cancelled this request before it arrived")
            body, rest = None, None
            if r.body is not None:
                if r.framed:  # the handler reads the bytes after the head as ``rest``
                    body, rest = parse_framed(r.body, data, headers.get(b"content-type"))
                else:
                    parse = parse_kept if r.kept else parse_body
                    body = parse(r.body, data, headers.get(b"content-type"))
                if principal.prefix is not None:
                    require_names(principal, _names(body))
            call: Call[Any] = Call(
                broker,
                method,
                path,
                adm.params,
                query_of(query) if query else {},
                headers,
                data,
                body,
                principal,
                who,
                self.state,
                gone,
            )
            call.rest = rest
            call.handover = scope.get(HANDOVER)
            handler = r.handler
            assert handler is not None, r.path
            if not r.once:
                reply = handler(call)
                if isinstance(reply, tuple):
                    return reply
                pending = reply
                return run_once(None, lambda: pending)
            slot = once_key(broker, method, path, call.session, call.request_id, who)
            if slot is not None:
                hit = slot[0].answers.get(slot[1])
                if hit is not None:
                    return hit
                if slot[1] in slot[0].running:  # the first attempt still runs: wait for its answer
                    return run_once(slot, lambda: _awaited(handler(call)))
            try:
                reply = handler(call)
            except DepotError as exc:
                if slot is None:
                    raise
                reply = exc.status, error_body(exc)
            if isinstance(reply, tuple):
                if slot is not None:
                    slot[0].remember(slot[1], *reply)
                return reply
            waiting = reply
            return run_once(slot, lambda: waiting)
        finally:
            memory.deferring = False

    def settle(self) -> None:
        """An answer is out: what its request retired is retired now."""
        self.broker.memory.retire_pending()

    # -- 3. errors -----------------------------------------------------------------------
    @staticmethod
    def failure(exc: BaseException, method: str = "", path: str = "") -> Answer:
        """The answer for an exception: a DepotError's status and body; a
        hang-up's 409; anything else is a bug, logged, and a bare 500."""
        if isinstance(exc, DepotError):
            return exc.status, error_body(exc)
        if isinstance(exc, ClientGone):
            return CANCELLED
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        log.error("exception in %s %s", method, path, exc_info=exc)
        return INTERNAL

    # -- 4. what every answer carries ----------------------------------------------------
    def head(self, status: int, media: str) -> list[tuple[bytes, bytes]]:
        """The headers of an answer, but its length: the server mark (every
        answer says it comes from a tensordepot broker), the content type,
        ``www-authenticate`` on 401."""
        key = (status, media)
        out = self._heads.get(key)
        if out is None:
            out = [MARK]
            if status == INTERNAL[0]:
                out.append((b"content-type", b"text/plain; charset=utf-8"))
            elif status != 204:
                out.append((b"content-type", (media if status < 300 else JSON).encode()))
            if status == 401:
                out.append((b"www-authenticate", b"Bearer"))
            self._heads[key] = out
        return out

    @staticmethod
    def reason(status: int) -> str:
        return REASONS.get(status, "")

    def observe(self, method: str, r: Route | None, status: int, started: float) -> None:
        self.metrics.observe_route(
            method, UNMATCHED if r is None else r.template, status, time.perf_counter() - started
        )
