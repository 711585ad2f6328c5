"""What a route's handler is, and what it is handed.

Every HTTP route of the broker has exactly one handler, a plain function
declared with ``@route(...)`` in one module of ``service/_http/routers/``.  The
declaration says everything else about the route, once: its method and
path template, the scope it needs, its short OpenAPI operation id, its body
model, what it answers, and whether a request id makes it idempotent.  The
route table (``service/_http/_routes.py``) collects the declarations; the gate
(``service/_http/_gate.py``) runs everything around a handler; the two doors
(``service/_http/_lane.py`` inside the HTTP protocol, ``service/_http/_asgi.py`` for
ASGI) hand it requests.

A handler takes a ``Call`` and returns an answer, ``(status, body)``, or an
awaitable of one when it must wait (a get for a version not yet published,
an allocation that needs a new segment).  An answer given at once costs no
task.  A handler raises ``DepotError`` for bad input; the gate turns it into
the one error body.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union

from pydantic import BaseModel, ValidationError

from ..._errors import InvalidRequest, RequestTooLarge, Unprocessable
from ..._proto import MAX_BODY_BYTES, MAX_WAIT, REQUEST_HEADER, SESSION_HEADER, unframe
from ..._wire import INLINE_MAX, MAX_NDIM, AllocRequest

if TYPE_CHECKING:
    from .._auth import Principal
    from .._registry._broker import Broker
    from .._registry._sessions import Caller

Answer = tuple[int, bytes]  # status, body (JSON unless the route says otherwise)
Reply = Union[Answer, Awaitable[Answer]]  # noqa: UP007  (a runtime alias: Python 3.10)
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

JSON = "application/json"
_SESSION, _REQUEST = SESSION_HEADER.encode(), REQUEST_HEADER.encode()


HANDOVER = "tensordepot.handover"  # in a scope: its door can pass descriptors (Handover)


class Handover:
    """What a door that can pass descriptors with an answer (the unix
    socket's fast lane) puts in a request's scope under ``HANDOVER``: the
    scope, and what a handler gives it to pass (``passing``: an object with
    ``fds()``, ``passed()`` and ``failed()``, the shared-memory lane's)."""

    __slots__ = ("passing", "scope")

    def __init__(self, scope: Any) -> None:
        self.scope = scope
        self.passing: Any = None


class Call(Generic[M]):
    """One request, as a handler sees it: the same object at both doors.

    ``body`` is the parsed body model of the route (None for a route without
    one), ``data`` the raw body bytes; ``params`` holds the path parameters,
    ``query`` the query string's (the last of repeated keys wins, blank
    values kept).  ``gone``, when the door can tell, returns an awaitable
    that resolves when the client hangs up (for waits)."""

    __slots__ = (
        "body",
        "broker",
        "data",
        "gone",
        "handover",
        "headers",
        "method",
        "params",
        "path",
        "principal",
        "query",
        "request_id",
        "rest",
        "session",
        "state",
        "who",
    )

    def __init__(
        self,
        broker: Broker,
        method: str,
        path: str,
        params: dict[str, str],
        query: Mapping[str, str],
        headers: dict[bytes, bytes],
        data: bytes,
        body: M | None,
        principal: Principal,
        who: Caller,
        state: Any,
        gone: Callable[[], Awaitable[Any]] | None,
    ) -> None:
        self.broker, self.method, self.path, self.params = broker, method, path, params
        self.query, self.headers, self.data, self.body = query, headers, data, body
        self.principal, self.who, self.state, self.gone = principal, who, state, gone
        self.rest: memoryview | None = None
        self.handover: Handover | None = None  # set by the gate where the door can pass fds
        # The session the request runs under, and its request id (None: not sent).
        self.session: str | None = self.header(_SESSION)
        self.request_id: str | None = self.header(_REQUEST)

    def header(self, name: bytes) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")


Handler = Callable[[Call[Any]], Reply]


@dataclass(frozen=True)
class Route:
    """One route of the table: everything about it, said once."""

    method: str
    path: str  # the template, Starlette's syntax: {name:path} spans slashes
    scope: str | None  # the scope it needs; None: open to anyone
    op: str  # the OpenAPI operation id: short and stable
    handler: Handler | None  # None: FastAPI serves it (the API documents)
    summary: str = ""
    tag: str = ""
    body: type[BaseModel] | None = None  # parsed (and its names prefix-checked) by the gate
    framed: bool = False  # the body is framed (``_proto.frame``): ``body`` is its JSON head
    kept: bool = False  # the body is parsed as its sender sends it step after step (parse_kept)
    handover: bool = False  # its answer may pass descriptors, where the door can (Handover)
    answers: Any = None  # the answer's model, for the OpenAPI document
    status: int = 200  # the status of a good answer
    media: str = JSON  # the content type of a good answer
    once: bool = False  # a request id makes it idempotent (the first answer is replayed)
    head: bool = True  # a GET route HEAD may ask too (False: the GET takes a lease)
    docs: dict[str, Any] = field(default_factory=dict)  # OpenAPI: parameters, requestBody
    note: str = ""  # SECURITY.md's scope table: who may use it beyond the scope
    # The path as OpenAPI and the metric labels name it: ``/v1/tensors/{name}``
    # (made once: every request's scope check and metric name it).
    template: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "template", self.path.replace(":path}", "}"))


def route(
    method: str, path: str, scope: str | None, op: str, **kw: Any
) -> Callable[[Handler], Handler]:
    """Declare the decorated function as the handler of one route.  The
    module's ``ROUTES`` list (made with ``routes_of``) collects it."""

    def declare(handler: Handler) -> Handler:
        handler.route = Route(method, path, scope, op, handler, **kw)  # type: ignore[attr-defined]
        return handler

    return declare


def routes_of(*handlers: Handler) -> list[Route]:
    return [h.route for h in handlers]  # type: ignore[attr-defined]


# -- parsing: the same rules at every door -------------------------------------------------


def bad_query(message: str) -> Unprocessable:
    return Unprocessable(f"invalid request: {message}")


def body_refused(length: bytes | None, seen: int = 0) -> RequestTooLarge | None:
    """The one body limit, for both doors: the error for a body announced
    (``length``, its Content-Length) or read so far (``seen`` bytes) over
    ``MAX_BODY_BYTES``, or None."""
    if (
        length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES)
    ) or seen > MAX_BODY_BYTES:
        return too_large()
    return None


def too_large() -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body is over {MAX_BODY_BYTES} bytes; send large "
        f"tensors through /v1/alloc and shared memory, and batches in parts"
    )


def invalid(exc: ValidationError) -> InvalidRequest:
    """A body that does not validate, described (422); a bad name in it is
    ``check_name``'s InvalidRequest (400), as everywhere else."""
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):
            where = ".".join(str(p) for p in err.get("loc", ()))
            return InvalidRequest(f"{where}: {cause}" if where else str(cause))
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where or 'request'}: {err.get('msg', 'invalid')}")
    return Unprocessable("invalid request: " + "; ".join(parts))


def parse_body(model: type[M], data: bytes, content_type: bytes | None) -> M:
    """A JSON body as ``model``: UTF-8 JSON (RFC 8259), sent as
    ``application/json`` or with no content type.  Anything else is bad input."""
    _json_media(content_type)
    return _validated(model, data)


def _json_media(content_type: bytes | None) -> None:
    if content_type is not None:
        media = content_type.partition(b";")[0].strip().lower()
        if media != b"application/json" and not media.endswith(b"+json"):
            raise InvalidRequest(
                f"the body must be JSON sent as 'content-type: application/json',"
                f" not {media.decode('latin-1')[:80]!r}"
            )


def _validated(model: type[M], data: bytes) -> M:
    try:
        return model.model_validate_json(data or b"null")
    except ValidationError as exc:
        raise invalid(exc) from None


def parse_framed(model: type[M], data: bytes, content_type: bytes | None) -> tuple[M, memoryview]:
    """A framed body (``_proto.frame``): its JSON head as ``model``, and the
    bytes after it.  Sent as ``application/octet-stream`` or with no content type."""
    if content_type is not None:
        media = content_type.partition(b";")[0].strip().lower()
        if media != b"application/octet-stream":
            raise InvalidRequest(
                f"this body is framed bytes (a JSON head, then the tensors' "
                f"bytes) sent as 'content-type: application/octet-stream', not "
                f"{media.decode('latin-1')[:80]!r}"
            )
    try:
        head, rest = unframe(data)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return parse_kept(model, head, None), rest


def parse_kept(model: type[M], data: bytes, content_type: bytes | None) -> M:
    """``parse_body``, keeping what the last ``HEADS_KEPT`` bodies of up to
    ``HEAD_KEPT_MAX`` bytes parsed as: the head of a framed put_many, the
    body of an alloc_many or a get_many (``Route.kept``)."""
    _json_media(content_type)
    if len(data) > HEAD_KEPT_MAX:
        return _validated(model, data)
    parsed: M = _keep(_heads, HEADS_KEPT, (model, data), lambda: _validated(model, data))
    return parsed


def _keep(cache: dict[Any, T], most: int, key: Any, make: Callable[[], T]) -> T:
    """``cache[key]``, made by ``make()`` the first time (what raises is not
    kept), in a cache of the last ``most`` keys made."""
    got = cache.get(key)
    if got is None:
        got = make()
        if len(cache) >= most:
            del cache[next(iter(cache))]
        cache[key] = got
    return got


# The bodies parse_kept parsed last, and what they parsed as: a producer
# sends the same head step after step (a state dict's names, shapes and
# dtypes), and parsing it is most of what its request costs the broker
# beyond placing; a consumer the same names (its floor in the query).  The
# models are shared by the requests that sent the same bytes: nothing
# changes one (the registry keeps its plan: ``_packs.Plans``).
# The content type is checked on every request, kept or not.
HEADS_KEPT = 16
HEAD_KEPT_MAX = 256 << 10  # a longer head is parsed each time
_heads: dict[tuple[type[Any], bytes], Any] = {}


def get_params(q: Mapping[str, str]) -> tuple[float | None, int, int]:
    """(seconds to wait or None for forever, newer_than, version) of a get's
    query; ``version`` (0: the newest) names one version, and waits for none."""
    try:
        timeout = float(q.get("timeout", 0.0))
        newer_than = int(q.get("newer_than", 0))
        version = int(q.get("version", 0))
    except ValueError:
        raise bad_query(
            "timeout must be a number of seconds (or inf), newer_than and version integers"
        ) from None
    if not timeout >= 0 or newer_than < 0 or version < 0:  # `not >=` also catches NaN
        raise bad_query("timeout, newer_than and version must be >= 0")
    if version and (timeout or newer_than):
        raise bad_query("version names one version, now: give it without timeout or newer_than")
    return (None if timeout > MAX_WAIT else timeout), newer_than, version


def _count(q: Mapping[str, str], key: str, what: str) -> int | None:
    """The whole number ``key`` of a query (None: not given), at most 18 digits."""
    raw = q.get(key)
    if raw is None:
        return None
    if not (raw.isdigit() and len(raw) <= 18):
        raise bad_query(f"{key} must be {what} (an integer >= 0)")
    return int(raw)


def known_param(q: Mapping[str, str]) -> int:
    """The ``known`` of a get_many's query: the key of an earlier answer's
    columns that the client holds for the names it asks for (0: none)."""
    return _count(q, "known", "the key of an earlier get_many answer") or 0


def floor_param(q: Mapping[str, str]) -> int | None:
    """The ``newer_than`` of a get_many's query: one version for every name
    (None: not given; the body may give one per name instead).  A batch got
    again and again sends the same body, parsed once (``Route.kept``)."""
    return _count(q, "newer_than", "a version")


PUTS_KEPT = 64  # put_params' answers kept: a producer puts the same names, shapes and dtypes
_puts: dict[tuple[str, str, str | None, str | None, str | None], AllocRequest] = {}


def put_params(name: str, q: Mapping[str, str], length: str) -> AllocRequest:
    """What an inline put's query and Content-Length ask for, checked.  The
    same request again (a producer putting one tensor step after step) gets
    the same checked answer back, kept (the last ``PUTS_KEPT``)."""
    key = (name, length, q.get("shape"), q.get("dtype"), q.get("ttl"))
    return _keep(_puts, PUTS_KEPT, key, lambda: _put_params(name, q, length))


def _put_params(name: str, q: Mapping[str, str], length: str) -> AllocRequest:
    if not length.isdigit() or int(length) > INLINE_MAX:
        raise InvalidRequest(
            f"put carries at most {INLINE_MAX} bytes with a Content-Length; "
            f"larger tensors go through /v1/alloc and /v1/publish"
        )
    if "dtype" not in q:
        raise bad_query("put needs ?dtype=")
    try:
        ttl = float(q["ttl"]) if q.get("ttl") else None
    except ValueError:
        ttl = -1.0
    if ttl is not None and not (0 < ttl < math.inf):
        raise bad_query("ttl must be a finite number of seconds > 0")
    shape, dtype = q.get("shape", ""), q["dtype"]
    if len(shape) > 400:
        raise bad_query(f"shape has {len(shape)} characters; at most 400 ({MAX_NDIM} dimensions)")
    try:
        dims = [int(d) for d in shape.split(",")] if shape else []
    except ValueError as exc:
        raise InvalidRequest(f"invalid put of {name!r}: {exc}") from None
    try:  # AllocRequest's own checks say what is wrong, as on every other route
        # (and validating takes half the time of model_construct)
        return AllocRequest(name=name, shape=dims, dtype=dtype, ttl=ttl)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid put of {name!r}: {exc}".splitlines()[0]) from None
