"""The broker's fast lane (service/_http/_lane.py), spoken to over a raw socket:
its answers are the ASGI routes' answers, in order on a connection whatever
mix of lane and ASGI requests is pipelined on it, and a client that hangs up
on a waiting get is granted nothing."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from tensordepot import Client
from tensordepot._proto import REQUEST_HEADER, SERVER_HEADER, SESSION_HEADER


class Raw:
    """One HTTP/1.1 connection to the broker's socket, requests written as bytes."""

    def __init__(self, broker: BrokerProc) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(broker.sock)
        self._buf = b""
        self.sid = ""
        try:
            answer = self.request("POST", "/v1/sessions", {"pid": 1})
            self.sid = json.loads(answer[2])["session"]
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        if self.sid:
            self.send(self.head("DELETE", f"/v1/sessions/{self.sid}"))
            self.read()
        self.sock.close()

    def head(self, method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
        lines = [
            f"{method} {path} HTTP/1.1",
            "Host: localhost",
            f"Content-Length: {len(body)}",
            "Content-Type: application/json",
        ]
        if self.sid:
            lines.append(f"{SESSION_HEADER}: {self.sid}")
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> tuple[int, dict[bytes, bytes], bytes]:
        """The next whole response (framed by Content-Length, as the broker's
        are): status, headers (lower-case names), body."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                lines = self._buf[:end].decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower().encode()] = v.strip().encode()
                length = int(headers.get(b"content-length", b"0"))
                if len(self._buf) >= end + 4 + length:
                    body = self._buf[end + 4 : end + 4 + length]
                    self._buf = self._buf[end + 4 + length :]
                    return int(lines[0].split()[1]), headers, body
            chunk = self.sock.recv(65536)
            assert chunk, "the broker closed the connection"
            self._buf += chunk

    def request(
        self, method: str, path: str, body: object = None, **headers: str
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        data = b"" if body is None else json.dumps(body).encode()
        self.send(self.head(method, path, data, **headers))
        return self.read()


def _read_all(raw: Raw, n: int) -> list[tuple[int, bytes]]:
    """``n`` pipelined responses: status and body."""
    return [(status, body) for status, _, body in (raw.read() for _ in range(n))]


@contextlib.contextmanager
def published(broker: BrokerProc) -> Iterator[tuple[Client, Raw]]:
    """A client that published "w" (float32, 4), and a raw connection."""
    with broker.client() as c:
        c.put("w", np.arange(4, dtype=np.float32))
        raw = Raw(broker)
        try:
            yield c, raw
        finally:
            raw.close()


def test_lane_answers_carry_what_every_answer_carries(broker: BrokerProc) -> None:
    with published(broker) as (_, raw):
        status, headers, body = raw.request("GET", "/v1/tensors/w")
        assert status == 200 and headers[SERVER_HEADER.encode()]
        assert headers[b"content-type"] == b"application/json"
        handle = json.loads(body)
        assert (handle["name"], handle["shape"], handle["lease"] > 0) == ("w", [4], True)
        status, headers, body = raw.request("POST", "/v1/release", {"leases": [handle["lease"]]})
        assert (status, json.loads(body)) == (200, {"released": 1})
        # Errors: the same codes and bodies as the routes behind ASGI.
        status, _, body = raw.request("GET", "/v1/tensors/absent")
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
        status, _, body = raw.request("GET", "/v1/tensors/w?timeout=nan")
        assert status == 422 and "timeout" in json.loads(body)["error"]["message"]
        status, _, body = raw.request("POST", "/v1/release", {"leases": "x"})
        assert status == 422 and "leases" in json.loads(body)["error"]["message"]
        status, _, body = raw.request("POST", "/v1/put/x?dtype=float32&shape=2", None)
        assert status == 400 and "needs 8" in json.loads(body)["error"]["message"]


def test_pipelined_requests_are_answered_in_order(broker: BrokerProc) -> None:
    with published(broker) as (c, raw):
        # A get that waits (lane, in a task), then an ASGI request and a lane
        # request behind it: the answers keep the order of the requests.
        raw.send(
            raw.head("GET", "/v1/tensors/late?timeout=30")
            + raw.head("GET", "/v1/stat")
            + raw.head("GET", "/v1/tensors/w")
        )
        wait_for(lambda: c.stat().waiting == 1, 10, what="the get to wait")
        c.put("late", np.ones(2, dtype=np.float32))
        answers = _read_all(raw, 3)
        assert [s for s, _ in answers] == [200, 200, 200]
        assert json.loads(answers[0][1])["name"] == "late"
        assert "bytes_in_use" in json.loads(answers[1][1])
        assert json.loads(answers[2][1])["name"] == "w"
        leases = [json.loads(answers[i][1])["lease"] for i in (0, 2)]
        assert raw.request("POST", "/v1/release", {"leases": leases})[0] == 200


def test_a_resend_replays_the_first_answer(broker: BrokerProc) -> None:
    with published(broker) as (c, raw):
        first = raw.request("GET", "/v1/tensors/w", **{REQUEST_HEADER: "rid-1"})
        again = raw.request("GET", "/v1/tensors/w", **{REQUEST_HEADER: "rid-1"})
        assert first[0] == again[0] == 200 and first[2] == again[2]
        assert c.stat().leases == 1, "the resend took a second lease"
        put = raw.head(
            "POST", "/v1/put/p?dtype=float32&shape=1", b"\0\0\0\0", **{REQUEST_HEADER: "rid-2"}
        )
        raw.send(put)
        v1 = json.loads(raw.read()[2])["version"]
        raw.send(put)
        assert json.loads(raw.read()[2])["version"] == v1 == 1
        lease = json.loads(first[2])["lease"]
        assert raw.request("POST", "/v1/release", {"leases": [lease]})[0] == 200


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
def test_a_client_that_hangs_up_on_a_waiting_get_gets_no_lease(
    broker: BrokerProc, many: bool
) -> None:
    with broker.client() as c:
        c.put("early", np.ones(2, dtype=np.float32))
        raw = Raw(broker)
        sid = raw.sid
        if many:  # the first name is there, the second is waited for
            body = json.dumps({"names": ["early", "late"], "timeout": 30}).encode()
            raw.send(raw.head("POST", "/v1/many/get", body))
        else:
            raw.send(raw.head("GET", "/v1/tensors/late?timeout=30"))
        wait_for(lambda: c.stat().waiting == 1, 10, what="the get to wait")
        raw.sock.close()  # hang up without closing the session
        wait_for(lambda: c.stat().waiting == 0, 10, what="the broker to stop waiting")
        c.put("late", np.ones(2, dtype=np.float32))
        assert c.stat().leases == 0
        raw2 = Raw(broker)
        raw2.sid, own = sid, raw2.sid
        try:
            assert raw2.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
        finally:
            raw2.sid = own
            raw2.close()


def test_connection_close_is_honoured(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("w", np.arange(4, dtype=np.float32))
        raw = Raw(broker)
        sid = raw.sid
        status, headers, body = raw.request("GET", "/v1/tensors/w", Connection="close")
        assert status == 200 and headers[b"connection"] == b"close"
        assert raw.sock.recv(1) == b"", "the broker kept the connection open"
        raw.sock.close()
        lease = json.loads(body)["lease"]
        raw = Raw(broker)
        own, raw.sid = raw.sid, sid
        try:
            assert raw.request("POST", "/v1/release", {"leases": [lease]})[0] == 200
            assert raw.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
        finally:
            raw.sid = own
            raw.close()
