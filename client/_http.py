"""HTTP to the broker without I/O: what both drivers share (in the manner of h11).

A client operation is a generator (``_core.py``, ``_ops.py``, ...).  It
yields *steps* and receives their results:

* a ``Request``: bytes to send (head and body, built here), with the
  rules for sending them; the driver answers ``(status, body)``, or throws
  a ``Failure`` (the connection failed) into the generator;
* an ``Offload``: work for the driver to run, off the event loop when it
  is not ``cheap`` (a copy into shared memory, GPU work, a whole blocking
  operation); the driver answers its result, or throws what it raised.

``drive`` runs an operation with a blocking ``roundtrip``; the asyncio
client has its own driver with the same meaning (``_async.py``).  Sockets
live in ``_transport.py`` (blocking) and ``_aio.py`` (the event loop).

Responses are parsed by httptools, the same parser the broker's server
uses: Content-Length and chunked framing, keep-alive, and malformed answers
all behave as HTTP says.

Resending (``exchange``, the one place that decides it).  A request is sent
again (once, on a fresh connection) only when that cannot apply it twice:
when it is idempotent, or when it carries a request id that the broker
remembers (``x-tensordepot-request``), so that a resend gets the first
answer.  A POST without either is never resent after it may have reached
the broker (README, Lifetime: M6).

This module is the client's one error boundary: transport failures become
``BrokerUnavailable`` and error bodies become the matching ``DepotError``.
An error built from a broker's answer has ``answered = True``; one without
it means the request may or may not have reached the broker.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import httptools
from pydantic import BaseModel

from .._errors import (
    BrokerUnavailable,
    DepotError,
    InvalidRequest,
    error_class,
)
from .._proto import MAX_WAIT, SERVER_HEADER

T = TypeVar("T")

_MAX_HEAD = 64 * 1024
_SERVER = SERVER_HEADER.encode()


class _Disconnected(ConnectionError):
    """The connection ended before a whole response arrived."""

    def __init__(self, message: str, got_bytes: bool) -> None:
        super().__init__(message)
        self.got_bytes = got_bytes


class _NotABroker(Exception):
    pass


# What a round trip raises when the connection or the peer fails (``fail`` says what it means).
FAILURES = (OSError, ValueError, _NotABroker)


class Answer:
    """One response, fed as it arrives (the httptools parser calls back into
    it).  Raises ``_NotABroker`` for bytes that are not HTTP, or (``finish``)
    for a first answer on a connection that lacks the broker's header."""

    __slots__ = ("_parser", "body", "done", "got", "head", "headers", "keep_alive")

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.head = 0  # bytes of headers so far
        self.done = False
        self.keep_alive = False
        self.got = False  # any bytes at all: a resend may apply the request twice
        self._parser = httptools.HttpResponseParser(self)

    # -- the parser's callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.head += len(name) + len(value)
        if self.head > _MAX_HEAD:
            raise ConnectionError("response headers too large")
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        # Asked here: once the message is complete the parser resets for the
        # next one, and should_keep_alive() then reads as False.
        self.keep_alive = self._parser.should_keep_alive()
        self.done = True

    def feed(self, chunk: bytes | memoryview) -> bool:
        """Parse the next bytes of the answer: whether it is whole now."""
        if not chunk:
            raise _Disconnected("the broker closed the connection", self.got)
        self.got = True
        try:
            self._parser.feed_data(chunk)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__  # what our callback raised
            if cause is not None and not isinstance(cause, Exception):
                raise cause from None  # Ctrl-C while the parser called us: not a bad answer
            raise _NotABroker(f"it sent a malformed HTTP response ({cause or exc})") from None
        except httptools.HttpParserError as exc:
            raise _NotABroker(f"it sent a malformed HTTP response ({exc})") from None
        return self.done

    def finish(self, verified: bool) -> tuple[int, bytes, bool]:
        """(status, body, keep the connection alive).  ``verified``: this
        connection's peer has already said it is a tensordepot broker."""
        status = self._parser.get_status_code()
        self._parser = None  # type: ignore[assignment]  # no cycle for the collector to find
        if not verified and _SERVER not in self.headers:
            raise _NotABroker(f"it answered {status} without the {SERVER_HEADER} header")
        return status, b"".join(self.body), self.keep_alive


@dataclass(frozen=True)
class Endpoint:
    """Where a broker URL points: a unix socket ``path``, or ``host`` and
    ``port``; and the request headers every request to it carries."""

    url: str
    path: str | None
    host: str
    port: int
    fixed: str  # "Host: ...\r\n" and the bearer token, if any

    @classmethod
    def parse(cls, url: str, token: str | None) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = (parts.netloc + parts.path) if parts.netloc else parts.path
            if not path:
                raise InvalidRequest(
                    f"broker URL {url!r} has no socket path; use unix:///path.sock"
                )
            host, port, host_header = "", 0, "localhost"
        elif parts.scheme == "http":
            if not parts.hostname:
                raise InvalidRequest(f"broker URL {url!r} has no host; use http://127.0.0.1:7420")
            path, host, port = None, parts.hostname, parts.port or 80
            host_header = f"{host}:{port}"
        else:
            raise InvalidRequest(f"broker URL {url!r}: use unix:///path.sock or http://host:port")
        fixed = f"Host: {host_header}\r\n"
        if token:
            fixed += f"Authorization: Bearer {token}\r\n"
        return cls(url, path, host, port, fixed)


def body_of(body: Any) -> tuple[bytes, str]:
    """A request body's bytes and content type (``encode``)."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body), "application/octet-stream"
    if body is None:
        return b"", "application/json"
    if isinstance(body, BaseModel):
        return body.__pydantic_serializer__.to_json(body), "application/json"
    return json.dumps(body, allow_nan=False).encode(), "application/json"  # the tests' raw ones


def encode(
    endpoint: Endpoint, method: str, path: str, body: Any, headers: dict[str, str] | None
) -> tuple[bytes, bytes]:
    """A request's head and body: ``body`` is a wire model (sent as JSON), bytes
    (sent as they are), or None (no body)."""
    data, ctype = body_of(body)
    extra = "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) if headers else ""
    head = (
        f"{method} {path} HTTP/1.1\r\n{endpoint.fixed}{extra}"
        f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode("latin-1")
    return head, data


def io_timeout(timeout: float | bool | None, default: float) -> float | None:
    """The I/O timeout of one request (``False``: the transport's default)."""
    t = default if timeout is False else timeout
    if isinstance(t, (int, float)) and t > MAX_WAIT:
        t = None  # socket timeouts overflow long before "forever" ends
    return t


def may_resend(exc: BaseException, *, resend: bool, reused: bool, method: str) -> bool:
    """Whether a request that failed with ``exc`` goes out again on a fresh
    connection: a kept-alive connection the broker closed while idle, or a
    connection cut mid-answer, when that cannot apply the request twice."""
    if not isinstance(exc, (_Disconnected, BrokenPipeError, ConnectionResetError)):
        return False
    nothing_back = not getattr(exc, "got_bytes", True)
    return resend or (reused and nothing_back and method == "GET")


def fail(exc: BaseException, url: str, where: str, timeout: float | None) -> NoReturn:
    """Raise what a transport failure means (call it in the ``except`` block)."""
    if isinstance(exc, TimeoutError):
        raise BrokerUnavailable(
            f"the broker at {url} did not answer {where} within {timeout} s; "
            f"is it overloaded or stopped?"
        ) from exc
    if isinstance(exc, _NotABroker):
        raise BrokerUnavailable(
            f"URL {url} is not a tensordepot broker: {exc}; point the client at "
            f"the broker's socket (tensordepot serve prints it)"
        ) from None
    raise unavailable(url, exc) from exc  # OSError, ValueError


def unavailable(url: str, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"cannot reach the tensordepot broker at {url} ({exc.__class__.__name__}: {exc}); "
        f"is `tensordepot serve` running, and does $TENSORDEPOT_URL point at its socket?"
    )


def error(status: int, payload: bytes) -> DepotError:
    """The ``DepotError`` an error answer stands for (``answered`` set)."""
    code, message = "", ""
    try:
        err = json.loads(payload)["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        message = f"the broker answered HTTP {status} without an error body"
    exc = error_class(status, code)(message)
    exc.answered = True  # type: ignore[attr-defined]
    return exc


# -- steps ----------------------------------------------------------------------------------


class Request:
    """One request for a driver to send: ``head`` and ``body`` are its bytes.

    ``timeout``: the I/O timeout (None: none).  ``fresh``: send it on a new
    connection (a resend).  ``keep``: it makes something the caller must
    finish or give back (an allocation, a publish, a session), so an asyncio
    driver lets it complete even when its caller is cancelled; ``opens``:
    it opens a session (concurrent callers may share one)."""

    __slots__ = ("body", "fresh", "head", "keep", "method", "opens", "path", "timeout")

    def __init__(
        self,
        method: str,
        path: str,
        head: bytes,
        body: bytes,
        timeout: float | None,
        *,
        keep: bool = False,
        opens: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.head = head
        self.body = body
        self.timeout = timeout
        self.fresh = False
        self.keep = keep
        self.opens = opens


class Offload:
    """Work for a driver to run: ``fn(*args)``.  Not ``cheap``: an asyncio
    driver runs it in a worker thread, and when its caller is cancelled lets
    it run to its end before the operation gives back what it made."""

    __slots__ = ("args", "cheap", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any, cheap: bool = False) -> None:
        self.fn = fn
        self.args = args
        self.cheap = cheap


def failed(conn: Any, reused: bool, exc: BaseException) -> None:
    """Call in the ``except BaseException`` block around one round trip on
    ``conn`` (``reused``: it was a kept-alive connection), then re-raise: the
    connection closes (after a cancel or Ctrl-C too: the broker sees the
    hang-up and stops waiting), and a failed connection raises ``Failure``."""
    conn.close()
    if isinstance(exc, FAILURES):
        raise Failure(exc, reused) from exc


def _nothing() -> None:
    return None


# Yielded after an operation made something that a cancelled caller must give
# back: an asyncio driver stops a cancelled operation there (no work to run).
COMMIT = Offload(_nothing, cheap=True)


class Failure(Exception):
    """What a driver throws into an operation when a request's connection
    failed: ``cause``, and whether the connection was a kept-alive one."""

    def __init__(self, cause: BaseException, reused: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.reused = reused


class LaneStep(Offload):
    """A request for the shared-memory lane (``_shmlane.on_lane``), yielded
    by an operation of a client whose driver runs on an event loop
    (``_aiolane``): the driver answers ``(status, body)``, or None to send
    it over HTTP.  Any other driver runs it as the offload it is, which
    answers None.  ``keep``: as ``Request``'s (a cancelled caller's
    allocation or publish on the lane completes, and is given back)."""

    __slots__ = ("data", "headers", "keep", "method", "path", "timeout")

    def __init__(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        data: bytes,
        timeout: float | None,
        *,
        keep: bool = False,
    ) -> None:
        super().__init__(_nothing, cheap=True)
        self.method = method
        self.path = path
        self.headers = headers
        self.data = data
        self.timeout = timeout
        self.keep = keep


Step = Request | Offload
Op = Generator[Step, Any, T]  # an operation: steps out, results in, its value at the end


def drive(op: Op[T], roundtrip: Callable[[Request], tuple[int, bytes]]) -> T:
    """Run ``op`` to its end here, sending its requests with ``roundtrip``
    (which raises ``Failure``) and running its offloads in this thread."""
    try:
        step = next(op)
        while True:
            try:
                if type(step) is Request:
                    result = roundtrip(step)
                else:
                    result = step.fn(*step.args)  # type: ignore[union-attr]
            except BaseException as exc:  # Ctrl-C too: the operation cleans up
                step = op.throw(exc)
            else:
                step = op.send(result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def exchange(
    endpoint: Endpoint,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    *,
    timeout: float | None,
    resend: bool,
    keep: bool = False,
    opens: bool = False,
) -> Op[tuple[int, bytes]]:
    """Send one request: ``(status, body)``.  ``resend``: it may go out a
    second time after a failure (it is idempotent, or carries a request id);
    the resend is the same bytes, on a fresh connection."""
    head, data = encode(endpoint, method, path, body, headers)
    req = Request(method, path, head, data, timeout, keep=keep, opens=opens)
    answer: tuple[int, bytes]
    try:
        answer = yield req
        return answer
    except Failure as failed:
        if not may_resend(failed.cause, resend=resend, reused=failed.reused, method=method):
            fail(failed.cause, endpoint.url, _where(method, path), timeout)
    req.fresh = True
    try:
        answer = yield req
        return answer
    except Failure as failed:
        fail(failed.cause, endpoint.url, _where(method, path), timeout)


def _where(method: str, path: str) -> str:
    return f"{method} {path.split('?')[0]}"


def decode(status: int, payload: bytes, raw: bool = False) -> Any:
    """The JSON of a broker's answer (None for 204 or no body; ``raw``: its
    bytes), or its error raised."""
    if status >= 400:
        raise error(status, payload)
    if raw:
        return payload
    if status == 204 or not payload:
        return None
    return json.loads(payload)


def _new_id_prefix() -> None:
    global _ID_PREFIX, _ids
    _ID_PREFIX, _ids = secrets.token_hex(8), itertools.count(1)


_ID_PREFIX = ""
_ids = itertools.count(1)
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)


def request_id() -> str:
    """A request id unique to this process (a random prefix and a counter): the
    broker keeps answers per session and id, so ids need only never repeat, and
    a counter costs no system call per request, as random bytes would."""
    return f"{_ID_PREFIX}{next(_ids):x}"
