"""Blocking HTTP/1.1 to the broker over a unix socket or TCP, with persistent
connections: the ``Client``'s sockets (``_http.py`` builds the bytes and
says what failures mean).

Each request goes out in a single send (http.client sends headers and body
separately, waking the broker twice).  On this class of machine the control
plane is the whole cost of a small get, and the client shares two cores with
the broker, so its CPU time matters: a round trip is one send and one receive
(usually one recv), nothing else.  Timeouts are the kernel's (``SO_RCVTIMEO``,
``SO_SNDTIMEO`` on a blocking socket; Python's socket timeouts poll(2) before
every send and receive), and answers are read into one buffer per connection
(``recv(n)`` of a large ``n`` maps and unmaps a fresh buffer every time).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from typing import Any

from ..shm._sigint import interruptible
from ._http import Answer, Endpoint, Request, decode, drive, exchange, failed, io_timeout
from ._trust import connected, peer_cred

# A connection idle this long is checked before use (one poll(2)); the broker
# closes idle ones only after its keep-alive timeout (120 s), or when it stops.
_IDLE = 1.0
_RECV = 262144  # bytes a connection reads at once


def _set_timeout(sock: socket.socket, timeout: float | None) -> None:
    """Blocking I/O on ``sock`` that gives up after ``timeout`` seconds without
    progress (None: never), as a socket timeout would, without its poll(2)s."""
    sock.settimeout(None)
    if timeout is None:
        sec, usec = 0, 0  # a zero timeval: wait forever
    else:
        sec, usec = int(timeout), round((timeout - int(timeout)) * 1e6)
        if usec >= 1_000_000:
            sec, usec = sec + 1, 0
        if not sec and not usec:
            usec = 1  # zero would mean forever
    tv = struct.pack("@ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Conn:
    """One persistent HTTP/1.1 connection, used by one request at a time."""

    def __init__(self, connect: Any) -> None:
        self._connect = connect
        self.sock: socket.socket | None = None
        self._timeout: float | None = -1.0
        self.verified = False  # the peer said it is a tensordepot broker
        self.used = 0.0  # when its last answer arrived
        self._buf = bytearray(_RECV)
        self._view = memoryview(self._buf)

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

    @interruptible
    def roundtrip(self, head: bytes, body: bytes, timeout: float | None) -> tuple[int, bytes]:
        if self.sock is not None and time.monotonic() - self.used > _IDLE and self._stale():
            self.close()  # reconnect now rather than fail a request that may not be resent
        if self.sock is None:
            self.sock = self._connect(timeout)
            self._timeout = -1.0
        sock = self.sock
        if timeout != self._timeout:
            _set_timeout(sock, timeout)
            self._timeout = timeout
        answer = Answer()
        buf, view = self._buf, self._view
        try:
            sock.sendall(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                sock.sendall(body)
            while not answer.feed(view[: sock.recv_into(buf)]):
                pass
        except BlockingIOError as exc:  # SO_RCVTIMEO or SO_SNDTIMEO ran out
            raise TimeoutError("timed out") from exc
        status, payload, keep_alive = answer.finish(self.verified)
        self.verified = True
        self.used = time.monotonic()
        if not keep_alive:
            self.close()
        return status, payload


class Transport:
    """Thread-safe: each request borrows an idle connection (or opens one), so
    a thread blocked in a long poll never stalls another thread's calls.

    A forked child never uses its parent's connections: it opens its own."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        trust: frozenset[int] | None = None,
    ) -> None:
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
                return connected(sock, path, trust)
        else:
            host, port = ep.host, ep.port

            def connect(timeout: float | None) -> socket.socket:
                sock = socket.create_connection((host, port), timeout=timeout)
                return connected(sock, (host, port), None)

        self._connect = connect
        self.endpoint = ep
        self.url = url
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
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

    def roundtrip(self, req: Request) -> tuple[int, bytes]:
        """Send ``req`` and read its answer: ``(status, body)``; a failed
        connection raises ``Failure`` (``failed``)."""
        conn = _Conn(self._connect) if req.fresh else self._borrow()
        reused = conn.sock is not None
        try:
            answer = conn.roundtrip(req.head, req.body, req.timeout)
        except BaseException as exc:
            failed(conn, reused, exc)
            raise
        self._give_back(conn)
        return answer

    def handover(
        self, head: bytes, body: bytes, timeout: float | None
    ) -> tuple[int, bytes, list[int], int | None]:
        """One request on a connection of its own, whose answer may carry
        descriptors (``POST /v1/lane``): ``(status, body, fds, the broker's
        pid)``, the descriptors of a 200 answer only (others' are closed).
        They come with the answer's first bytes; a read without room for
        them gets none (the kernel closes them)."""
        sock = self._connect(timeout)
        fds: list[int] = []
        try:
            _set_timeout(sock, timeout)
            sock.sendall(head + body)
            answer = Answer()
            data, fds, flags, _ = socket.recv_fds(sock, _RECV, 4)
            if flags & socket.MSG_CTRUNC:
                fds = _closed(fds)
            while not answer.feed(memoryview(data)):
                data = sock.recv(_RECV)
            status, payload, _ = answer.finish(False)
            if status != 200:
                fds = _closed(fds)
            pid = peer_cred(sock)[0]
            return status, payload, fds, pid or None
        except BaseException:
            _closed(fds)
            raise
        finally:
            sock.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | bool | None = False,
        resend: bool = True,
    ) -> Any:
        """One request outside any session: its decoded JSON (None for 204).
        Raises DepotError."""
        op = exchange(
            self.endpoint,
            method,
            path,
            body,
            headers,
            timeout=io_timeout(timeout, self.timeout),
            resend=resend,
        )
        return decode(*drive(op, self.roundtrip))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _closed(fds: list[int]) -> list[int]:
    for fd in fds:
        os.close(fd)
    return []
