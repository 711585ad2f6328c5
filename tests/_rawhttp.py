"""HTTP/1.1 written as bytes, for the requests that ordinary clients never
send: oversized heads, chunked bodies, odd encodings, ``Expect:
100-continue`` with the body sent at once.

``exchange`` sends one request on a new connection (a unix socket path, or
a ``(host, port)`` pair) and reads one answer, skipping interim ``1xx``
answers.  The request is written in one ``sendall`` from a thread while the
answer is read, so a broker that answers before it has read the whole body
(413, 431) is heard, not cut off by a full socket buffer.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

Address = str | tuple[str, int]


@dataclass(frozen=True)
class Answer:
    """One HTTP answer: status, headers (lower-case names, in order), body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    interim: tuple[int, ...] = field(default=())  # the 1xx answers read before it

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        """The error code of an ``{"error": {"code", "message"}}`` body, else None."""
        try:
            body = json.loads(self.body)
        except ValueError:
            return None
        err = body.get("error") if isinstance(body, dict) else None
        return err.get("code") if isinstance(err, dict) else None


def chunked(body: bytes, size: int = 1 << 20) -> bytes:
    """``body`` in the chunked transfer coding, in chunks of ``size`` bytes."""
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


def encode(
    method: str,
    target: str | bytes,
    headers: list[tuple[str, str]],
    body: bytes | None = None,
    *,
    chunk: bool = False,
) -> bytes:
    """A request as bytes.  ``body`` gets a Content-Length (or the chunked
    coding with ``chunk``); None sends no body and no length."""
    raw_target = target if isinstance(target, bytes) else target.encode("latin-1")
    lines = [b"%s %s HTTP/1.1" % (method.encode(), raw_target), b"Host: localhost"]
    lines += [f"{k}: {v}".encode("latin-1") for k, v in headers]
    if body is not None:
        lines.append(b"Transfer-Encoding: chunked" if chunk else b"Content-Length: %d" % len(body))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    if body is None:
        return head
    return head + (chunked(body) if chunk else body)


def connect(address: Address, timeout: float) -> socket.socket:
    if not isinstance(address, str):
        return socket.create_connection(address, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def more(self) -> None:
        try:
            chunk = self.sock.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buf += chunk

    def until(self, sep: bytes) -> bytes:
        while (at := self.buf.find(sep)) < 0:
            if self.eof:
                raise ConnectionError(f"the connection closed mid-answer (read {self.buf[:200]!r})")
            self.more()
        out, self.buf = self.buf[:at], self.buf[at + len(sep) :]
        return out

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise ConnectionError(f"the connection closed after {len(self.buf)} of {n} bytes")
            self.more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while not self.eof:
            self.more()
        out, self.buf = self.buf, b""
        return out


def read_answer(reader: _Reader, method: str) -> Answer:
    interim: list[int] = []
    while True:
        head = reader.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = tuple(
            (k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in head[1:])
        )
        if 100 <= status < 200:
            interim.append(status)
            continue
        values = dict(headers)
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif "chunked" in values.get("transfer-encoding", "").lower():
            parts = []
            while size := int(reader.until(b"\r\n").split(b";")[0], 16):
                parts.append(reader.take(size))
                reader.until(b"\r\n")
            reader.until(b"\r\n")  # no trailers are expected
            body = b"".join(parts)
        elif "content-length" in values:
            body = reader.take(int(values["content-length"]))
        else:
            body = reader.rest()
        return Answer(status, headers, body, tuple(interim))


def exchange(address: Address, data: bytes, *, method: str = "", timeout: float = 30) -> Answer:
    """Send ``data`` (one request) on a new connection and read its answer."""
    method = method or data.split(b" ", 1)[0].decode("latin-1")
    sock = connect(address, timeout)
    sent: list[BaseException] = []

    def send() -> None:
        try:
            sock.sendall(data)
        except OSError as exc:  # it answered and closed while we were still sending
            sent.append(exc)

    writer = threading.Thread(target=send, daemon=True)
    try:
        writer.start()
        return read_answer(_Reader(sock), method)
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        writer.join(timeout)
        sock.close()


class Session:
    """Plain JSON requests on a broker's unix socket, under a session of their
    own: ``send`` answers ``(status, decoded body)``."""

    def __init__(self, sock: str) -> None:
        import os

        self.sock = sock
        self.sid = ""
        status, answer = self.send("POST", "/v1/sessions", {"pid": os.getpid(), "label": "raw"})
        assert status == 200, answer
        self.sid = answer["session"]

    def send(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        from tensordepot._proto import SESSION_HEADER

        headers = [("content-type", "application/json")]
        if self.sid:
            headers.append((SESSION_HEADER, self.sid))
        data = None if body is None else json.dumps(body).encode()
        answer = exchange(self.sock, encode(method, path, headers, data))
        return answer.status, json.loads(answer.body or b"null")

    def close(self) -> None:
        self.send("DELETE", f"/v1/sessions/{self.sid}")
