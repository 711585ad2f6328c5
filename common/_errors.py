"""The exception tree, shared by the client and the broker.

    DepotError
     ├── BrokerUnavailable      the broker cannot be reached (not running, killed, shutting down)
     ├── TensorNotFound         no such name (or no ready version of it)
     │    └── WaitTimedOut      a get waited and nothing (newer) came in time; also a TimeoutError
     ├── OutOfMemory            the allocation does not fit in --max-memory (HTTP 507)
     ├── AuthError              missing or unknown credentials (HTTP 401)
     │    ├── Forbidden         known credentials, but not allowed to do that (HTTP 403)
     │    └── UntrustedBroker   the socket or a segment belongs to a user this client does not trust
     ├── InvalidRequest         bad input: dtype, shape, name, byte counts (HTTP 400);
     │    │                     also a ValueError
     │    ├── InvalidType       an argument of the wrong type; also a TypeError
     │    ├── Unprocessable     a body or query that does not validate (HTTP 422)
     │    ├── RequestTooLarge   a body over the limit (HTTP 413)
     │    │    └── HeadersTooLarge  a request head over the limit (HTTP 431)
     │    └── NoRoute           no route serves the path (HTTP 404)
     │         └── MethodNotAllowed  not with this method (HTTP 405)
     ├── Conflict               the request clashes with the tensor's state (HTTP 409)
     │    ├── UnknownSession    the session named ended, or the broker restarted
     │    └── Cancelled         the client hung up or cancelled the request
     ├── LimitExceeded          a per-client limit: sessions, connections (HTTP 429)
     ├── TensorReleased         you released this tensor and then used it
     └── TensorBroken           the broker or the owner died; the cause is in ``__cause__``

Each class has its own ``status`` and ``code`` (class attributes: nothing
sets them on an instance).  The broker turns an error into its status and
``error_body`` (``{"error": {"code", "message"}}``); the client turns that
back into the same class with ``error_class(status, code)``, a table
derived from the classes.  Errors are translated at exactly those two
boundaries.
"""

from __future__ import annotations

import json


class DepotError(Exception):
    """Base class of every tensordepot error."""

    code = "depot_error"
    status = 400


class BrokerUnavailable(DepotError):
    """The broker could not be reached, died, or is shutting down."""

    code = "broker_unavailable"
    status = 503


class TensorNotFound(DepotError, KeyError):
    """No tensor by that name (or it has no published version yet)."""

    code = "not_found"
    status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class WaitTimedOut(TensorNotFound, TimeoutError):
    """A get that waited (``timeout`` > 0) and saw nothing (newer) published
    in time: a ``TensorNotFound`` (a ``KeyError``) and a ``TimeoutError``."""

    code = "timed_out"
    status = 404


class OutOfMemory(DepotError, MemoryError):
    """The broker's memory quota (--max-memory) cannot fit the allocation."""

    code = "out_of_memory"
    status = 507


class AuthError(DepotError):
    """The request lacked valid credentials."""

    code = "unauthorized"
    status = 401


class Forbidden(AuthError):
    """The broker knows who is asking, and that identity may not do this
    (a missing scope, a name outside the token's prefix, a uid not allowed)."""

    code = "forbidden"
    status = 403


class UntrustedBroker(AuthError):
    """Raised by the client, never sent by the broker: the socket it reached,
    or a segment it was told to map, belongs to a user it does not trust (or
    is writable by anyone).  Someone may be impersonating the broker."""

    code = "untrusted_broker"
    status = 403


class InvalidRequest(DepotError, ValueError):
    """The request was malformed: bad name, dtype, shape, or byte count."""

    code = "invalid_request"
    status = 400


class InvalidType(InvalidRequest, TypeError):
    """An argument of the wrong type (a dict where a tensor goes, a str timeout)."""

    code = "invalid_type"


class Unprocessable(InvalidRequest):
    """A request body or query that does not validate (HTTP 422)."""

    status = 422


class RequestTooLarge(InvalidRequest):
    """A request body over the broker's limit (HTTP 413)."""

    code = "too_large"
    status = 413


class HeadersTooLarge(RequestTooLarge):
    """A request head over the broker's limit (HTTP 431)."""

    status = 431


class NoRoute(InvalidRequest):
    """No route serves this path (HTTP 404)."""

    code = "no_such_route"
    status = 404


class MethodNotAllowed(NoRoute):
    """A route serves this path, but not with this method (HTTP 405)."""

    code = "method_not_allowed"
    status = 405


class Conflict(DepotError):
    """The request clashes with the tensor's current state."""

    code = "conflict"
    status = 409


class UnknownSession(Conflict):
    """The session a request names is unknown: it ended (the process exited,
    its heartbeats stopped) or the broker restarted.  The client opens a new
    one and sends the request again."""

    code = "unknown_session"


class Cancelled(Conflict):
    """The client hung up or cancelled the request before its answer."""

    code = "cancelled"


class LimitExceeded(DepotError):
    """A per-client limit was reached (sessions per process, the session table)."""

    code = "limit_exceeded"
    status = 429


class TensorReleased(DepotError):
    """The SharedTensor was released and cannot be used any more."""

    code = "released"
    status = 400


class TensorBroken(DepotError):
    """The broker or the owner of a tensor died; see ``__cause__``."""

    code = "broken"
    status = 410


def _classes() -> list[type[DepotError]]:
    """DepotError and every subclass, parents before children."""
    out: list[type[DepotError]] = []
    todo: list[type[DepotError]] = [DepotError]
    while todo:
        cls = todo.pop(0)
        if cls not in out:
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return out


def _tables() -> tuple[dict[tuple[int, str], type[DepotError]], dict[int, type[DepotError]]]:
    by_both: dict[tuple[int, str], type[DepotError]] = {}
    by_status: dict[int, type[DepotError]] = {}
    for cls in _classes():
        key = (cls.status, cls.code)
        if by_both.setdefault(key, cls) is not cls:
            raise TypeError(
                f"{cls.__name__} and {by_both[key].__name__} share status and "
                f"code {key}: give each its own"
            )
        by_status.setdefault(cls.status, cls)  # the most general class of a status
    return by_both, by_status


_BY_BOTH, _BY_STATUS = _tables()


def error_class(status: int, code: str) -> type[DepotError]:
    """The class of an error answer: by status and code, else (a code this
    client does not know) the most general class of its status."""
    return _BY_BOTH.get((status, code)) or _BY_STATUS.get(status, DepotError)


def error_classes() -> list[type[DepotError]]:
    """Every error class of the API, parents before children."""
    return [cls for cls in _classes() if not cls.__name__.startswith("_")]


CODES = frozenset(code for _, code in _BY_BOTH)  # every code an error answer may carry


def error_body(exc: DepotError) -> bytes:
    """The one error body: ``{"error": {"code", "message"}}``, UTF-8 JSON."""
    return json.dumps(
        {"error": {"code": exc.code, "message": str(exc)}},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()
