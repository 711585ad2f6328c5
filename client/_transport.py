"""HTTP/1.1 to the broker over a unix socket or TCP, with persistent connections.

http.client is used directly: on this class of machine a FastAPI round trip
costs ~0.65 ms through it against ~1.1 ms through httpx (DESIGN.md,
"Physics"), and the control plane is the whole cost of a small get.

This module is the client's one error boundary: transport failures become
``BrokerUnavailable`` and error bodies become the matching ``DepotError``.
"""

from __future__ import annotations

import http.client
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

_BY_STATUS: dict[int, type[DepotError]] = {
    400: InvalidRequest, 401: AuthError, 403: AuthError, 404: TensorNotFound, 409: Conflict,
    422: InvalidRequest, 503: BrokerUnavailable, 507: OutOfMemory,
}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _TcpConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Transport:
    """Thread-safe: each request borrows an idle connection (or opens one), so
    a thread blocked in a long poll never stalls another thread's calls."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = (parts.netloc + parts.path) if parts.netloc else parts.path
            self._factory = lambda t: _UnixConnection(path, t)
        elif parts.scheme == "http":
            if not parts.hostname:
                raise InvalidRequest(f"broker URL {url!r} has no host; use http://127.0.0.1:7420")
            host, port = parts.hostname, parts.port or 80
            self._factory = lambda t: _TcpConnection(host, port, timeout=t)
        else:
            raise InvalidRequest(f"broker URL {url!r}: use unix:///path.sock or http://host:port")
        self.url = url
        self.timeout = timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.round_trips = 0
        self._closed = False

    def _borrow(self, timeout: float | None) -> http.client.HTTPConnection:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._factory(timeout)
        else:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        return conn

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()  # the transport was closed while this request ran

    def request(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
                timeout: float | None | bool = False) -> Any:
        """Send one request; return the decoded JSON (None for 204).  Raises DepotError."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        hdrs = self._headers if not headers else {**self._headers, **headers}
        t = self.timeout if timeout is False else timeout
        conn = self._borrow(t)  # type: ignore[arg-type]
        self.round_trips += 1
        for attempt in (0, 1):
            try:
                conn.request(method, path, data, hdrs)
                resp = conn.getresponse()
                payload = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                conn.close()
                # A kept-alive connection the broker closed while idle: retry once
                # on a fresh one.  A second failure means the broker is gone.
                if attempt == 0:
                    continue
                raise self._unavailable(exc) from exc
            except TimeoutError as exc:
                conn.close()
                raise BrokerUnavailable(
                    f"the broker at {self.url} did not answer {method} {path} within {t} s; "
                    f"is it overloaded or stopped (SIGSTOP)?"
                ) from exc
            except OSError as exc:
                conn.close()
                raise self._unavailable(exc) from exc
        if resp.will_close:
            conn.close()
        self._give_back(conn)
        if resp.status >= 400:
            raise self._error(resp.status, payload)
        if resp.status == 204 or not payload:
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
