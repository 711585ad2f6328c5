"""The exception tree, shared by the client and the broker.

    DepotError
     ├── BrokerUnavailable      the broker cannot be reached (not running, killed, shutting down)
     ├── TensorNotFound         no such name (or no ready version of it)
     │    └── WaitTimedOut      a get waited and nothing (newer) came in time; also a TimeoutError
     ├── OutOfMemory            the allocation does not fit in --max-memory (HTTP 507)
     ├── AuthError              missing or unknown credentials (HTTP 401)
     │    ├── Forbidden         known credentials, but not allowed to do that (HTTP 403)
     │    └── UntrustedBroker   the socket or a segment belongs to a user this client does not trust
     ├── InvalidRequest         bad input: dtype, shape, name, byte counts (HTTP 400/422);
     │    │                     also a ValueError
     │    └── InvalidType       an argument of the wrong type; also a TypeError
     ├── Conflict               the request clashes with the tensor's state (HTTP 409)
     ├── LimitExceeded          a per-client limit: sessions, connections (HTTP 429)
     ├── TensorReleased         you released this tensor and then used it
     └── TensorBroken           the broker or the owner died; the cause is in ``__cause__``

The broker raises these and one exception handler turns them into
``{"error": {"code", "message"}}`` with ``status``; the client turns that
body back into the same class.  Errors are translated at exactly those two
boundaries.
"""

from __future__ import annotations


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


class Conflict(DepotError):
    """The request clashes with the tensor's current state."""

    code = "conflict"
    status = 409


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


ERRORS_BY_CODE: dict[str, type[DepotError]] = {
    cls.code: cls
    for cls in (DepotError, BrokerUnavailable, TensorNotFound, WaitTimedOut, OutOfMemory,
                AuthError, Forbidden, InvalidRequest, Conflict, LimitExceeded, TensorReleased,
                TensorBroken)
}
