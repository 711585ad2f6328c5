"""A unix-socket relay between a client and a real broker that misbehaves on
request, the way a flaky network, a proxy or a dying peer does:

* ``cut_next_response(n)``: the next response is cut after ``n`` bytes and
  the connection dropped (the broker has acted on the request);
* ``drop_next_request()``: the next request is read and the connection
  dropped without forwarding it (the broker never sees it);
* ``chunked = True``: responses are re-framed with chunked transfer encoding
  instead of Content-Length, as many HTTP servers and proxies send them;
* ``requests``: every request as it arrived (head and body), to inspect.

It is a tool of the tests, run in threads of the test process; the broker
and the clients on either side are real.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading

from typing_extensions import Self


def _read_message(sock: socket.socket, buf: bytearray) -> bytes | None:
    """One HTTP message framed by Content-Length (what our clients and the
    broker send); None at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    while len(buf) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    msg = bytes(buf[: end + length])
    del buf[: end + length]
    return msg


def _chunked(response: bytes) -> bytes:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"content-length")]
    lines.append(b"transfer-encoding: chunked")
    out = b"\r\n".join(lines) + b"\r\n\r\n"
    for i in range(0, len(body), 7):  # small chunks, so framing really matters
        piece = body[i : i + 7]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\n\r\n"


class Relay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("unix://")
        self.dir = tempfile.mkdtemp(prefix="td-relay-", dir="/tmp")
        self.path = os.path.join(self.dir, "relay.sock")
        self.url = "unix://" + self.path
        self.requests: list[bytes] = []
        self.chunked = False
        self._cut: list[int] = []
        self._drop = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._conns: list[socket.socket] = []
        self.accepted = 0  # client connections, over the relay's life
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next_response(self, after: int) -> None:
        with self._lock:
            self._cut.append(after)

    def drop_next_request(self) -> None:
        with self._lock:
            self._drop += 1

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(client)
                self.accepted += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._lock:
            self._conns.append(up)
        try:
            up.connect(self.upstream)
            cbuf, ubuf = bytearray(), bytearray()
            while True:
                req = _read_message(client, cbuf)
                if req is None:
                    return
                with self._lock:
                    self.requests.append(req)
                    drop = self._drop > 0
                    if drop:
                        self._drop -= 1
                if drop:
                    return
                up.sendall(req)
                resp = _read_message(up, ubuf)
                if resp is None:
                    return
                with self._lock:
                    cut = self._cut.pop(0) if self._cut else None
                if cut is not None:
                    client.sendall(resp[:cut])
                    return
                client.sendall(_chunked(resp) if self.chunked else resp)
        except OSError:
            return
        finally:
            for s in (client, up):
                s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
