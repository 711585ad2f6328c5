"""A shared-memory lane taken by hand, for tests of the broker's lane door
(service/_http/_shmlane.py): the handover over a raw unix socket, then
records written and read as the client library would, or as it never would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Any

from _rawhttp import encode, exchange
from tensordepot._laneproto import parse_answer, request_record
from tensordepot._proto import SESSION_HEADER
from tensordepot.shm._board import BoardView
from tensordepot.shm._lanemem import BROKER, CLIENT, LaneMemory


def handover(sock_path: str, sid: str) -> tuple[int, Any, list[int]]:
    """``POST /v1/lane`` for session ``sid`` on a connection of its own:
    (status, the answer's JSON, the descriptors that came with it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    try:
        s.sendall(
            (
                f"POST /v1/lane HTTP/1.1\r\nHost: localhost\r\n{SESSION_HEADER}: {sid}\r\n"
                "Content-Length: 0\r\nConnection: close\r\n\r\n"
            ).encode()
        )
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
        while b"\r\n\r\n" not in data:
            more = s.recv(1 << 16)
            if not more:
                break
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            more = s.recv(1 << 16)
            if not more:
                break
            body += more
        return int(head.split(b" ", 2)[1]), json.loads(body or b"null"), fds
    finally:
        s.close()


class RawLane:
    """A lane adopted from a handover: ``call`` sends a request record and
    waits for its answer; ``mem`` is there to scribble on."""

    def __init__(self, fds: list[int]) -> None:
        self.mem = LaneMemory.adopt(fds[:3])
        self.board = BoardView(fds[3])  # the board of newest versions (shm._board)
        self.seq = 0

    def send(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        self.seq += 1
        rec = request_record(self.seq, method, target, headers or [], body)
        assert self.mem.requests.put(rec)  # type: ignore[union-attr]
        self.mem.ring(BROKER)
        return self.seq

    def answer(self, timeout: float = 10.0) -> tuple[int, int, bytes] | None:
        """The next answer (seq, status, body), or None if none comes in time."""
        got = self.answer_with_media(timeout)
        return None if got is None else (got[0], got[1], got[3])

    def answer_with_media(self, timeout: float = 10.0) -> tuple[int, int, int, bytes] | None:
        """The next answer (seq, status, media kind, body), or None if none
        comes in time."""
        deadline = time.monotonic() + timeout
        while True:  # a bell may still be set from an answer taken already
            rec = self.mem.answers.take()  # type: ignore[union-attr]
            if rec is not None:
                return parse_answer(rec)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.mem.wait(CLIENT, left)

    def call(self, method: str, target: str, body: bytes = b"") -> tuple[int, Any]:
        seq = self.send(method, target, body)
        got = self.answer()
        assert got is not None and got[0] == seq, got
        return got[1], json.loads(got[2] or b"null")

    def close(self) -> None:
        self.mem.close()
        self.board.close()


def answered(b: Any, method: str, route: str) -> int:
    """Requests broker ``b`` (a ``BrokerProc``) answered on ``route``, by any
    door, from its /metrics."""
    text = exchange(b.sock, encode("GET", "/metrics", [])).body.decode()
    pattern = (
        rf'^tensordepot_http_request_duration_seconds_count\{{(?=.*method="{method}")'
        rf'(?=.*route="{re.escape(route)}").*\}} (\S+)$'
    )
    return int(sum(float(m) for m in re.findall(pattern, text, re.M)))


def lane_fds(pid: int) -> int:
    """How many lane descriptors (memfds of lanes, eventfds) process ``pid``
    holds open: its connections come and go with its clients' pools."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        n += link.startswith("/memfd:tensordepot-lane") or link == "anon_inode:[eventfd]"
    return n
