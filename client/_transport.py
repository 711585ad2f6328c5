"""HTTP/1.1 to the broker over a unix socket or TCP, with persistent connections.

A minimal HTTP/1.1 client of our own: each request goes out in a single
send (http.client sends headers and body separately, waking the broker
twice) and responses are parsed without the email package.  On this class
of machine the control plane is the whole cost of a small get, and the
client shares two cores with the broker, so its CPU time matters.  The broker
always answers with Content-Length (JSON bodies, never chunked).

This module is the client's one error boundary: transport failures become
``BrokerUnavailable`` and error bodies become the matching ``DepotError``.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from .._errors import (
    ERRORS_BY_CODE,
    AuthError,
    BrokerUnavailable,
    Conflict,
    DepotError,
    InvalidRequest,
    OutOfMemory,
    TensorNotFound,
)
from ._trust import check_broker_socket

_BY_STATUS: dict[int, type[DepotError]] = {
    400: InvalidRequest, 401: AuthError, 403: AuthError, 404: TensorNotFound, 409: Conflict,
    422: InvalidRequest, 503: BrokerUnavailable, 507: OutOfMemory,
}
_MAX_HEAD = 64 * 1024


class _Disconnected(ConnectionError):
    """The broker closed the connection before answering."""


class _Conn:
    """One persistent HTTP/1.1 connection."""

    def __init__(self, connect: Any) -> None:
        self._connect = connect
        self.sock: socket.socket | None = None
        self._timeout: float | None = -1.0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def roundtrip(self, head: bytes, body: bytes, timeout: float | None) -> tuple[int, bytes]:
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
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise _Disconnected("the broker closed the connection")
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > _MAX_HEAD:
                raise ConnectionError("response headers too large")
        lines = buf[:end].split(b"\r\n")
        status = int(lines[0].split(None, 2)[1])
        length, close = 0, False
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            key = key.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"connection" and value.strip().lower() == b"close":
                close = True
        data = buf[end + 4:]
        while len(data) < length:
            chunk = sock.recv(max(65536, length - len(data)))
            if not chunk:
                raise _Disconnected("mid-body")
            data += chunk
        if close:
            self.close()
        return status, data[:length]


class Transport:
    """Thread-safe: each request borrows an idle connection (or opens one), so
    a thread blocked in a long poll never stalls another thread's calls."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 trust: frozenset[int] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = (parts.netloc + parts.path) if parts.netloc else parts.path

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

            self._connect = connect
            host_header = "localhost"
        elif parts.scheme == "http":
            if not parts.hostname:
                raise InvalidRequest(f"broker URL {url!r} has no host; use http://127.0.0.1:7420")
            host, port = parts.hostname, parts.port or 80

            def connect(timeout: float | None) -> socket.socket:
                sock = socket.create_connection((host, port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock

            self._connect = connect
            host_header = f"{host}:{port}"
        else:
            raise InvalidRequest(f"broker URL {url!r}: use unix:///path.sock or http://host:port")
        self.url = url
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        fixed = f"Host: {host_header}\r\n"
        if token:
            fixed += f"Authorization: Bearer {token}\r\n"
        self._fixed = fixed
        self.round_trips = 0
        self._closed = False

    def _borrow(self) -> _Conn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Conn(self._connect)

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()  # the transport was closed while this request ran

    def request(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
                timeout: float | None | bool = False) -> Any:
        """Send one request; return the decoded JSON (None for 204).  Raises DepotError."""
        if isinstance(body, bytes):
            data, ctype = body, "application/octet-stream"
        else:
            data, ctype = (b"" if body is None else json.dumps(body).encode()), "application/json"
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (f"{method} {path} HTTP/1.1\r\n{self._fixed}{extra}"
                f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n").encode("latin-1")
        t = self.timeout if timeout is False else timeout
        conn = self._borrow()
        self.round_trips += 1
        for attempt in (0, 1):
            reused = conn.sock is not None
            try:
                status, payload = conn.roundtrip(head, data, t)
                break
            except (_Disconnected, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                # A kept-alive connection the broker closed while idle: retry once
                # on a fresh one.  A failure on a fresh one means the broker is gone.
                if attempt == 0 and reused:
                    continue
                raise self._unavailable(exc) from exc
            except TimeoutError as exc:
                conn.close()
                raise BrokerUnavailable(
                    f"the broker at {self.url} did not answer {method} {path.split('?')[0]} "
                    f"within {t} s; is it overloaded or stopped?"
                ) from exc
            except (OSError, ValueError, IndexError) as exc:
                conn.close()
                raise self._unavailable(exc) from exc
        self._give_back(conn)
        if status >= 400:
            raise self._error(status, payload)
        if status == 204 or not payload:
            return None
        return json.loads(payload)

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"cannot reach the tensordepot broker at {self.url} ({exc.__class__.__name__}: {exc}); "
            f"is `tensordepot serve` running, and does $TENSORDEPOT_URL point at its socket?"
        )

    def _error(self, status: int, payload: bytes) -> DepotError:
        code, message = "", payload.decode(errors="replace")[:500]
        try:
            err = json.loads(payload)["error"]
            code, message = err["code"], err["message"]
        except (ValueError, KeyError, TypeError):
            pass
        cls = ERRORS_BY_CODE.get(code) or _BY_STATUS.get(status, DepotError)
        exc = cls(message)
        if code:
            exc.code = code
        return exc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
