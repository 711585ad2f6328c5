"""The fast lane: the broker's routes answered inside the HTTP protocol.

A request served through ASGI costs the broker a task, a request-response
cycle, two socket writes (head, then body) and a walk through the
middleware; on a machine where the broker, its clients and their copies
share two cores, that is most of a small get's cost.  ``PeerCredProtocol``
(service/_http/_server.py) therefore hands every request to this module as soon
as its head is parsed, and the lane is a protocol adapter:

* **parse**: method, path, query and headers, from uvicorn's parser;
* **admit**: the gate's ``admit`` at the end of the head (route, principal,
  scope, the name in the path), so a request that is refused is never
  buffered: its body is read and dropped, and it is answered at its end;
* **handle**: the gate's ``dispatch``, the same code the ASGI door runs;
* **reply**: one write.  What can be answered at once is answered at once;
  what must wait (a get for a version not yet published, an allocation
  that needs a new segment) runs as a task, during which the connection
  counts as busy: a pipelined request behind it goes the ASGI way and
  waits its turn, as uvicorn queues any pipelined request.

The lane declines (and ASGI serves, through the same gate) the API
documents, HEAD, upgrades, ``Expect: 100-continue``, a connection with a
response in flight, and any request that asks for ASGI with the header
``x-tensordepot-door: asgi`` (to compare the doors).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.parse
from collections.abc import Awaitable
from typing import Any, Protocol

import httptools

from ..._errors import Conflict
from ._gate import Admitted, Gate
from ._handler import HANDOVER, Answer, Handover, Reply, body_refused


class PeerCredProtocol(Protocol):
    """What the lane uses of the HTTP protocol that hands it requests
    (service/_http/_server.py ``PeerCredProtocol``, a uvicorn protocol)."""

    parser: Any
    cycle: Any
    expect_100_continue: Any
    limit_concurrency: Any
    scope: Any
    url: Any
    loop: Any
    tasks: Any
    transport: Any

    def on_response_complete(self) -> None: ...


DOOR_HEADER = b"x-tensordepot-door"


class LaneRequest:
    """One request the lane has taken, from its head to its answer."""

    __slots__ = (
        "admitted",
        "body",
        "busy",
        "error",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "scope",
        "seen",
        "started",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: bytes,
        scope: dict[str, Any],
        headers: dict[bytes, bytes],
        keep_alive: bool,
    ) -> None:
        self.method, self.path, self.query, self.scope = method, path, query, scope
        self.headers, self.keep_alive = headers, keep_alive
        self.admitted: Admitted | None = None
        self.error: BaseException | None = None  # refused at the head: the body is dropped
        self.body: list[bytes] = []  # the body's chunks as they came: joined once, at its end
        self.seen = 0  # bytes of it read
        self.busy: _Busy | None = None  # set while the answer waits in a task
        self.started = time.perf_counter()

    def lost(self) -> Awaitable[None]:
        """Resolves when the client hangs up (while the answer waits)."""
        assert self.busy is not None
        return self.busy.message_event.future


class _Lost:
    """``_Busy.message_event``: uvicorn calls ``set()`` when the connection is
    lost; ``future`` is what a parked get watches for a hang-up."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def set(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _Busy:
    """What ``PeerCredProtocol.cycle`` holds while a lane request waits: as
    uvicorn's own cycle, it makes later pipelined requests queue, learns of a
    hang-up (``disconnected``, ``message_event``) and of shutdown (``keep_alive``)."""

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = _Lost()


_DISCARD = 64 << 10  # a refused request's body up to this size is read (and dropped)


class Lane:
    """The fast lane of one app: a door to its gate."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._heads: dict[tuple[int, str], bytes] = {}

    # -- the protocol's hooks ----------------------------------------------------
    def take(self, proto: PeerCredProtocol) -> LaneRequest | None:
        """At the end of a request's head: a LaneRequest if the lane serves it."""
        parser = proto.parser
        if (
            (proto.cycle is not None and not proto.cycle.response_complete)
            or proto.expect_100_continue
            or parser.should_upgrade()
            or proto.limit_concurrency is not None
        ):
            return None
        method = parser.get_method().decode("ascii")
        if method == "HEAD":
            return None
        scope: dict[str, Any] = proto.scope
        # Names are lower case; the first of repeated headers wins, as in
        # Starlette's request.headers.get().
        headers: dict[bytes, bytes] = dict(reversed(scope["headers"]))
        if headers.get(DOOR_HEADER) == b"asgi":
            return None
        url = httptools.parse_url(proto.url)
        path = url.path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)  # as uvicorn decodes the path it hands to ASGI
        scope["method"], scope["path"] = method, path
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        req = LaneRequest(method, path, url.query or b"", scope, headers, keep_alive)
        try:
            req.admitted = self.gate.admit(method, path, scope)
        except BaseException as exc:
            req.error = exc
        else:
            if req.admitted.route.handler is None:
                return None  # an API document: FastAPI's own, through ASGI
            req.error = body_refused(headers.get(b"content-length"))
            if req.admitted.route.handover and scope["state"].get("unix"):
                scope[HANDOVER] = Handover(scope)  # this door passes descriptors (_send)
        return req

    def refuse_now(self, proto: PeerCredProtocol, req: LaneRequest) -> bool:
        """A request refused at its head (401, 403, 404, 413...) with a large
        or chunked body still to come is answered now and its connection
        closed: its body is never read, so a peer without a token cannot make
        the broker wait for, or hold, anything.  False: answer it as usual,
        at its end, on a connection kept alive: a refused request whose
        body is small (at most ``_DISCARD`` bytes, dropped as they come, never
        held) is read to its end first, since closing a socket with unread
        bytes in it resets the connection, and the peer may then never read
        the answer (a 404 racing its own body)."""
        h = req.headers
        length = h.get(b"content-length", b"0")
        if req.error is None or (
            b"transfer-encoding" not in h and length.isdigit() and int(length) <= _DISCARD
        ):
            return False
        req.keep_alive = False
        self.run(proto, req)
        return True

    def body(self, req: LaneRequest, chunk: bytes) -> None:
        if req.error is not None:
            return
        req.seen += len(chunk)
        req.error = body_refused(None, req.seen)
        if req.error is not None:
            req.body = []
        else:
            req.body.append(chunk)

    def run(self, proto: PeerCredProtocol, req: LaneRequest) -> None:
        """At the end of a request's body: answer it now, or start a task that will."""
        gate = self.gate
        reply: Reply
        if req.error is not None or req.admitted is None:
            reply = gate.failure(req.error or AssertionError("not admitted"), req.method, req.path)
        else:
            try:
                reply = gate.dispatch(
                    req.admitted,
                    req.method,
                    req.path,
                    req.scope,
                    req.headers,
                    req.query,
                    b"".join(req.body),  # one chunk: that chunk, not a copy
                    req.lost,
                )
            except BaseException as exc:  # every error becomes an answer
                reply = gate.failure(exc, req.method, req.path)
        if isinstance(reply, tuple):
            # A publish that woke parked gets answers first: its writer hears
            # back at once, and the gets' readers in the loop's next step.
            # (Measured on two shared cores, the other order made the whole
            # handoff slower: the reader's wake-up delays the writer's answer.)
            self._send(proto, req, reply)
            gate.settle()
            return
        gate.settle()
        busy = req.busy = _Busy(req.keep_alive)
        proto.cycle = busy

        async def finish(pending: Awaitable[Answer]) -> None:
            try:
                result = await pending
            except BaseException as exc:
                result = gate.failure(exc, req.method, req.path)
            busy.response_complete = True
            req.keep_alive = busy.keep_alive
            if not busy.disconnected:
                self._send(proto, req, result)

        task = proto.loop.create_task(finish(reply))
        task.add_done_callback(proto.tasks.discard)
        proto.tasks.add(task)

    # -- reply -------------------------------------------------------------------
    def _send(self, proto: PeerCredProtocol, req: LaneRequest, answer: Answer) -> None:
        status, body = answer
        gate = self.gate
        transport = proto.transport
        handover = req.scope.pop(HANDOVER, None)  # (it refers to the scope: no cycle left)
        passing = None if handover is None else handover.passing
        if passing is not None and (
            status != 200 or transport.is_closing() or transport.get_write_buffer_size()
        ):
            # Descriptors go with the answer's first byte: only on a
            # connection with nothing else still to write before it.
            passing.failed()
            passing = None
            if status == 200:
                status, body = gate.failure(
                    Conflict("the lane could not be handed over on this connection: keep HTTP")
                )
        r = None if req.admitted is None else req.admitted.route
        media = "application/json" if r is None else r.media
        first = self._heads.get((status, media))
        if first is None:  # the status line and the gate's headers, made once per kind
            first = self._heads[(status, media)] = b"".join(
                [
                    b"HTTP/1.1 %d %s\r\n" % (status, gate.reason(status).encode()),
                    *(b"%s: %s\r\n" % kv for kv in gate.head(status, media)),
                ]
            )
        head = [first]
        if status != 204:
            head.append(b"content-length: %d\r\n" % len(body))
        if status == 500:
            req.keep_alive = False
        if not req.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        data = b"".join(head) + body if status != 204 else b"".join(head)
        if passing is not None:
            data = _pass(transport, passing, data)
        if not transport.is_closing():
            transport.write(data)
        gate.observe(req.method, r, status, req.started)
        if not req.keep_alive:
            transport.close()
        else:
            proto.on_response_complete()


def _pass(transport: Any, passing: Any, data: bytes) -> bytes:
    """Send the start of an answer with the descriptors a handler hands over
    (``_handler.Handover``), in one ``sendmsg`` on a duplicate of the
    connection's socket (whose buffer is empty: it takes a short answer
    whole); what is left of it to write.  If the kernel refuses (the peer is
    gone), the lane is closed and so is the connection."""
    fd = transport.get_extra_info("socket").fileno()
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sent = socket.send_fds(sock, [data], passing.fds())
    except OSError:
        passing.failed()
        transport.close()
        return b""
    passing.passed()
    return data[sent:]
