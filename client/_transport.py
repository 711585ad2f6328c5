"""HTTP/1.1 to the broker over a unix socket or TCP, with persistent connections.

Each request goes out in a single send (http.client sends headers and body
separately, waking the broker twice), and responses are parsed by httptools,
the same parser the broker's server uses: Content-Length and chunked
framing, keep-alive, and malformed answers all behave as HTTP says.  On this
class of machine the control plane is the whole cost of a small get, and the
client shares two cores with the broker, so its CPU time matters.

Resending.  A request is sent again (once, on a fresh connection) only when
that cannot apply it twice: when it is idempotent, or when it carries a
request id that the broker remembers (``x-tensordepot-request``), so that a
resend gets the first answer.  A POST without either is never resent after
it may have reached the broker (README, Lifetime: M6).

This module is the client's one error boundary: transport failures become
``BrokerUnavailable`` and error bodies become the matching ``DepotError``.
An error built from a broker's answer has ``answered = True``; one without
it means the request may or may not have reached the broker.

The asyncio client (``_async.py``) shares everything here but the sockets:
``Endpoint`` (the URL), ``encode`` (a request's bytes), ``Answer`` (parsing
one response), ``may_resend`` and ``fail`` (what a failure means) and
``decode_answer`` (an answer's JSON or its error).
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httptools

from .._errors import (
    ERRORS_BY_CODE,
    AuthError,
    BrokerUnavailable,
    Conflict,
    DepotError,
    Forbidden,
    InvalidRequest,
    LimitExceeded,
    OutOfMemory,
    TensorNotFound,
)
from .._proto import MAX_WAIT, SERVER_HEADER
from ._trust import check_broker_socket

_BY_STATUS: dict[int, type[DepotError]] = {
    400: InvalidRequest, 401: AuthError, 403: Forbidden, 404: TensorNotFound, 409: Conflict,
    413: InvalidRequest, 422: InvalidRequest, 429: LimitExceeded, 431: InvalidRequest,
    503: BrokerUnavailable, 507: OutOfMemory,
}
_MAX_HEAD = 64 * 1024
# A connection idle this long is checked before use (one poll(2)); the broker
# closes idle ones only after its keep-alive timeout (120 s), or when it stops.
_IDLE = 1.0
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


class _Response:
    """httptools parser callbacks: collect one response."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.head = 0
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

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
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()
        self.done = True


class Answer:
    """One response, fed as it arrives.  Raises ``_NotABroker`` for bytes that
    are not HTTP, or (``finish``) for a first answer on a connection that lacks
    the broker's header."""

    def __init__(self) -> None:
        self._resp = _Response()
        self._parser = self._resp.parser = httptools.HttpResponseParser(self._resp)
        self.got = False  # any bytes at all: a resend may apply the request twice

    @property
    def done(self) -> bool:
        return self._resp.done

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            raise _Disconnected("the broker closed the connection", self.got)
        self.got = True
        try:
            self._parser.feed_data(chunk)
        except httptools.HttpParserError as exc:
            raise _NotABroker(f"it sent a malformed HTTP response ({exc})") from None

    def finish(self, verified: bool) -> tuple[int, bytes, bool]:
        """(status, body, keep the connection alive).  ``verified``: this
        connection's peer has already said it is a tensordepot broker."""
        status = self._parser.get_status_code()
        if not verified and _SERVER not in self._resp.headers:
            raise _NotABroker(f"it answered {status} without the {SERVER_HEADER} header")
        return status, b"".join(self._resp.body), self._resp.keep_alive


class _Conn:
    """One persistent HTTP/1.1 connection, used by one request at a time."""

    def __init__(self, connect: Any) -> None:
        self._connect = connect
        self.sock: socket.socket | None = None
        self._timeout: float | None = -1.0
        self.verified = False  # the peer said it is a tensordepot broker
        self.used = 0.0  # when its last answer arrived

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _stale(self) -> bool:
        """Whether the broker closed this idle connection (its keep-alive
        timeout, a restart): the socket then reads as EOF.  An idle HTTP
        connection has nothing to read, so any byte means it is unusable too."""
        assert self.sock is not None
        poller = select.poll()  # not recv(MSG_DONTWAIT): a socket with a timeout waits anyway
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def roundtrip(self, head: bytes, body: bytes, timeout: float | None) -> tuple[int, bytes]:
        if self.sock is not None and time.monotonic() - self.used > _IDLE and self._stale():
            self.close()  # reconnect now rather than fail a request that may not be resent
        if self.sock is None:
            self.sock = self._connect(timeout)
            self._timeout = timeout
        sock = self.sock
        if timeout != self._timeout:
            sock.settimeout(timeout)
            self._timeout = timeout
        sock.sendall(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            sock.sendall(body)
        answer = Answer()
        while not answer.done:
            answer.feed(sock.recv(262144))
        status, payload, keep_alive = answer.finish(self.verified)
        self.verified = True
        self.used = time.monotonic()
        if not keep_alive:
            self.close()
        return status, payload


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
                raise InvalidRequest(f"broker URL {url!r} has no socket path; use unix:///path.sock")
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


def encode(endpoint: Endpoint, method: str, path: str, body: Any,
           headers: dict[str, str] | None) -> tuple[bytes, bytes]:
    """A request's head and body: ``body`` is bytes (sent as they are), or
    JSON-able (None: no body)."""
    if isinstance(body, bytes):
        data, ctype = body, "application/octet-stream"
    else:
        data = b"" if body is None else json.dumps(body, allow_nan=False).encode()
        ctype = "application/json"
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
    head = (f"{method} {path} HTTP/1.1\r\n{endpoint.fixed}{extra}"
            f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n").encode("latin-1")
    return head, data


def io_timeout(timeout: float | bool | None, default: float) -> float | None:
    """The I/O timeout of one request (``False``: the transport's default)."""
    t = default if timeout is False else timeout
    if isinstance(t, (int, float)) and t > MAX_WAIT:
        t = None  # socket timeouts overflow long before "forever" ends
    return t


def may_resend(exc: BaseException, attempt: int, *, resend: bool, reused: bool,
               method: str) -> bool:
    """Whether a request that failed with ``exc`` goes out again on a fresh
    connection: a kept-alive connection the broker closed while idle, or a
    connection cut mid-answer, when that cannot apply the request twice."""
    if attempt or not isinstance(exc, (_Disconnected, BrokenPipeError, ConnectionResetError)):
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


def decode_answer(status: int, payload: bytes) -> Any:
    """The JSON of a broker's answer (None for 204 or no body), or its error raised."""
    if status >= 400:
        raise error(status, payload)
    if status == 204 or not payload:
        return None
    return json.loads(payload)


def error(status: int, payload: bytes) -> DepotError:
    """The ``DepotError`` an error answer stands for (``answered`` set)."""
    code, message = "", ""
    try:
        err = json.loads(payload)["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        message = f"the broker answered HTTP {status} without an error body"
    cls = ERRORS_BY_CODE.get(code) or _BY_STATUS.get(status, DepotError)
    exc = cls(message)
    if code:
        exc.code = code
    exc.answered = True  # type: ignore[attr-defined]
    return exc


class Transport:
    """Thread-safe: each request borrows an idle connection (or opens one), so
    a thread blocked in a long poll never stalls another thread's calls.

    A forked child never uses its parent's connections: it opens its own."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 trust: frozenset[int] | None = None) -> None:
        ep = Endpoint.parse(url, token)
        if ep.path is not None:
            path = ep.path

            def connect(timeout: float | None) -> socket.socket:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(path)
                except OSError:
                    sock.close()
                    raise
                check_broker_socket(sock, path, trust)  # who listens there?  (UntrustedBroker)
                return sock
        else:
            host, port = ep.host, ep.port

            def connect(timeout: float | None) -> socket.socket:
                sock = socket.create_connection((host, port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock

        self._connect = connect
        self._endpoint = ep
        self.url = url
        self.timeout = timeout
        self._token = token
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self.round_trips = 0
        self._closed = False
        self._pid = os.getpid()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's connections without touching
        them (closing our copy of an fd sends nothing to the broker), and take
        a fresh lock (the parent's may have been held at fork)."""
        self._lock = threading.Lock()
        for conn in self._idle:
            conn.close()
        self._idle = []
        self._pid = os.getpid()

    def _borrow(self) -> _Conn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Conn(self._connect)

    def _give_back(self, conn: _Conn) -> None:
        if conn.sock is not None:
            with self._lock:
                if not self._closed and self._pid == os.getpid():
                    self._idle.append(conn)
                    return
        conn.close()

    def request(self, method: str, path: str, body: Any = None, *,
                headers: dict[str, str] | None = None,
                timeout: float | bool | None = False, resend: bool = True,
                decode: bool = True) -> Any:
        """Send one request; return the decoded JSON (None for 204), or with
        ``decode=False`` the body's bytes.  Raises DepotError.

        ``resend``: the request may be sent a second time after a failure
        (it is idempotent, or carries a request id)."""
        head, data = encode(self._endpoint, method, path, body, headers)
        t = io_timeout(timeout, self.timeout)
        where = f"{method} {path.split('?')[0]}"
        conn = self._borrow()
        self.round_trips += 1
        try:
            for attempt in (0, 1):
                reused = conn.sock is not None
                try:
                    status, payload = conn.roundtrip(head, data, t)
                    break
                except FAILURES as exc:
                    conn.close()
                    if may_resend(exc, attempt, resend=resend, reused=reused, method=method):
                        continue
                    fail(exc, self.url, where, t)
        except BaseException:
            conn.close()  # also on Ctrl-C: the broker sees the hang-up and stops waiting
            raise
        self._give_back(conn)
        if not decode:
            if status >= 400:
                raise error(status, payload)
            return payload
        return decode_answer(status, payload)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
