"""HTTP/1.1 to the broker on the running event loop: the ``AsyncClient``'s sockets.

Requests go out on non-blocking sockets driven by the running event loop
(``loop.add_reader`` and ``add_writer``), with the same request bytes, HTTP
parser (httptools) and rules as the blocking transport (``_http.py`` holds
them).  A small pool keeps idle connections, so concurrent calls each get
one and never queue behind a long poll.  An idle connection is a plain
socket that the loop does not watch: a forked child drops the ones it
inherited by closing its copies of their fds, never touching the parent's
event loop (asyncio's epoll instance is shared across fork).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable
from typing import Any, TypeVar

from ._http import Answer, Endpoint, Request, failed
from ._trust import connected

T = TypeVar("T")
_MAX_IDLE = 64  # idle connections kept; more are closed when they come back
_RECV = 262144


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _ready(sock: socket.socket, *, write: bool, deadline: float | None) -> None:
    """Wait until ``sock`` can be read (or written), or raise TimeoutError at
    ``deadline`` (the loop's clock).  The loop watches the fd only meanwhile."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _wake, fut)
    else:
        loop.add_reader(fd, _wake, fut)
    timer = None if deadline is None else loop.call_at(deadline, _expire, fut)
    try:
        await fut
    finally:
        # At once, before anyone may close the socket and reuse its fd number.
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


async def _send(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await _ready(sock, write=True, deadline=deadline)


async def _recv(sock: socket.socket, deadline: float | None) -> bytes:
    while True:
        try:
            return sock.recv(_RECV)
        except BlockingIOError:
            await _ready(sock, write=False, deadline=deadline)


async def _within(deadline: float | None, aw: Awaitable[T]) -> T:
    """``aw``, or TimeoutError at ``deadline`` (for connecting only: it costs a task)."""
    if deadline is None:
        return await aw
    try:
        return await asyncio.wait_for(aw, max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise TimeoutError() from None


class _Conn:
    """One persistent HTTP/1.1 connection, used by one request at a time."""

    sock: socket.socket | None = None
    verified = False  # the peer said it is a tensordepot broker

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class AsyncTransport:
    """HTTP/1.1 to the broker on the running event loop (``_http.py`` builds
    the bytes and says what failures mean)."""

    def __init__(
        self, url: str, *, token: str | None, timeout: float, trust: frozenset[int]
    ) -> None:
        self._endpoint = Endpoint.parse(url, token)
        self.url = url
        self.timeout = timeout
        self._trust = trust
        self._idle: list[_Conn] = []
        self._pid = os.getpid()
        self._closed = False

    async def _connect(self, deadline: float | None) -> socket.socket:
        loop = asyncio.get_running_loop()
        ep = self._endpoint
        if ep.path is not None:
            targets: list[tuple[int, Any]] = [(socket.AF_UNIX, ep.path)]
        else:
            infos = await _within(
                deadline, loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
            )
            targets = [(family, addr) for family, _, _, _, addr in infos]
        error = OSError(f"{ep.host} has no address")
        for family, addr in targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await _within(deadline, loop.sock_connect(sock, addr))
                return connected(sock, addr, self._trust)
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    async def _roundtrip(
        self, conn: _Conn, head: bytes, body: bytes, timeout: float | None
    ) -> tuple[int, bytes]:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if conn.sock is None:
            conn.sock = await self._connect(deadline)
        sock = conn.sock
        await _send(sock, head + body if len(body) < 65536 else head, deadline)
        if len(body) >= 65536:
            await _send(sock, body, deadline)
        answer = Answer()
        while not answer.done:
            answer.feed(await _recv(sock, deadline))
        status, payload, keep_alive = answer.finish(conn.verified)
        conn.verified = True
        if not keep_alive:
            conn.close()
        return status, payload

    def _borrow(self) -> _Conn:
        if self._pid != os.getpid():
            self.after_fork()
        return self._idle.pop() if self._idle else _Conn()

    def _give_back(self, conn: _Conn) -> None:
        if (
            conn.sock is not None
            and not self._closed
            and self._pid == os.getpid()
            and len(self._idle) < _MAX_IDLE
        ):
            self._idle.append(conn)
        else:
            conn.close()

    def after_fork(self) -> None:
        """In a forked child: close our copies of the parent's idle connections
        (that sends nothing: the parent still holds them), and start afresh."""
        for conn in self._idle:
            conn.close()
        self._idle = []
        self._pid = os.getpid()

    async def roundtrip(self, req: Request) -> tuple[int, bytes]:
        """Send ``req`` and read its answer: ``(status, body)``; a failed
        connection raises ``Failure``, and a cancelled call closes it (``failed``)."""
        conn = _Conn() if req.fresh else self._borrow()
        reused = conn.sock is not None
        try:
            answer = await self._roundtrip(conn, req.head, req.body, req.timeout)
        except BaseException as exc:
            failed(conn, reused, exc)
            raise
        self._give_back(conn)
        return answer

    def close(self) -> None:
        """Close the idle connections; those in use close when they come back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
