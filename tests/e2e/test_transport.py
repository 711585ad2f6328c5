"""The control plane under a misbehaving network and careless callers, with a
real broker (README, Lifetime: M4, M6): requests are applied once, framing
is HTTP's, timeouts are checked once, and nothing a client drops is lost."""

from __future__ import annotations

import json
import math
import select
import signal
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _rawhttp import _Reader, connect, encode, read_answer
from _relay import Relay
from tensordepot import BrokerUnavailable, Client, InvalidRequest, InvalidType, TensorNotFound


def test_a_put_whose_answer_was_cut_is_applied_once(broker: BrokerProc) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        relay.cut_next_response(40)  # mid-head: the broker has put, the client never heard
        assert c.put("w", np.arange(8, dtype=np.float32)) == 1, "the resend made a second version"
        big = np.arange(1 << 18, dtype=np.float32)  # through alloc + publish
        relay.cut_next_response(150)  # the alloc's answer, mid-body
        assert c.put("big", big) == 1
        st = c.stat()
        assert (st.versions, st.bytes_in_use) == (2, 32 + big.nbytes), (
            "an orphaned allocation was left"
        )
        assert np.array_equal(np.from_dlpack(c.get("big")), big)


def test_a_get_whose_answer_was_cut_takes_one_lease(broker: BrokerProc) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        c.put("w", np.arange(8, dtype=np.float32))
        relay.cut_next_response(60)
        t = c.get("w")
        assert c.stat().leases == 1
        del t
        wait_for(lambda: c.stat().leases == 0, 5, what="the one lease to be released")


def test_close_returns_once_the_broker_has_ended_the_session(broker: BrokerProc) -> None:
    """The background thread may end the session (a view died) while close()
    runs in another thread: close() still returns only after the broker has
    ended it, so the proxy in between may go away (or the process exit) at once."""
    import random

    with broker.client() as probe:
        probe.put("w", np.arange(8, dtype=np.float32))
        for i in range(30):
            with Relay(broker.url) as relay:
                c = Client(relay.url)
                t = c.get("w")
                del t  # wakes the background thread, which finishes a pending close
                time.sleep(random.uniform(0, 0.02))  # jitter: both sides of its wake-up
                c.close()
            # Not ended by now, it never will be: the relay is gone and this process lives.
            wait_for(lambda: probe.stat().sessions == 1, 2, what=f"round {i}: the session to end")
        assert probe.stat().leases == 0


def test_chunked_responses_are_understood(broker: BrokerProc) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        relay.chunked = True
        c.put("w", np.arange(1000, dtype=np.int64))
        assert np.array_equal(np.from_dlpack(c.get("w")), np.arange(1000))
        assert [i.name for i in c.list()] == ["w"]
        assert c.stat().tensors == 1


def test_releases_riding_on_a_failed_request_are_not_lost(broker: BrokerProc) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        c.put("w", np.arange(8, dtype=np.float32))
        t = c.get("w")
        lease = t._lease_id()
        assert c._bg is not None
        c._bg._armed = True  # hold the background thread back: the release must ride a request
        del t  # queued for release; the next request carries it...
        relay.drop_next_request()  # ...and that request never reaches the broker
        with pytest.raises(BrokerUnavailable):
            c._call("POST", "/v1/sessions/x/claim")  # a request that is not resent
        assert any(f"x-tensordepot-release: {lease}".encode() in r for r in relay.requests)
        wait_for(lambda: c.stat().leases == 0, 5, what="the release to be sent again")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_requests_reuse_one_kept_alive_connection(broker: BrokerProc, chunked: bool) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        relay.chunked = chunked
        for i in range(20):
            c.put("w", np.full(4, i, dtype=np.float32))
            assert np.from_dlpack(c.get("w"))[0] == i
        assert c.stat().tensors == 1
        # One connection for the foreground; the background thread may have
        # borrowed a second while a release went out during a request.
        assert relay.accepted <= 2, f"{relay.accepted} connections for {c.round_trips} requests"


def test_an_idle_connection_the_broker_closed_is_not_reused(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("w", np.arange(4, dtype=np.float32))
        t = c.get("w")
        idle = list(c._transport._idle)
        assert idle, "the client kept no connection"
        for conn in idle:  # the broker closes them, as after its keep-alive timeout
            assert conn.sock is not None
            conn.sock.shutdown(socket.SHUT_WR)
            wait_for(
                lambda s=conn.sock: select.select([s], [], [], 0)[0],
                5,
                what="the broker to close the connection",
            )
        del t  # the release (a POST that is never resent) must not go out on a closed connection
        wait_for(lambda: broker.stat().leases == 0, 5, what="the release to reach the broker")


def test_not_a_broker_says_so(tmp_path_factory: pytest.TempPathFactory) -> None:
    import http.server
    import socketserver

    class Plain(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(501)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "20")
            self.end_headers()
            self.wfile.write(b"<html>nope</html>   ")

        def log_message(self, *a: object) -> None:
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Plain) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(BrokerUnavailable, match=r"is not a tensordepot broker"):
            Client(url)
        srv.shutdown()


# -- timeouts, checked once -----------------------------------------------------------------------


def test_a_stopped_broker_times_out_and_the_client_recovers(broker: BrokerProc) -> None:
    """SIGSTOP past the client's I/O timeout: the call gives up after about
    that long, says so, and once the broker runs again the same client works."""
    assert broker.proc is not None
    with Client(broker.url, timeout=0.5) as c:
        c.put("x", np.arange(4, dtype=np.float32))
        failed: list[BaseException] = []

        def stat() -> None:
            try:
                c.stat()
            except BaseException as exc:
                failed.append(exc)

        broker.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            caller = threading.Thread(target=stat, daemon=True)
            caller.start()
            caller.join(10)
            took = time.monotonic() - t0
            assert not caller.is_alive(), "stat() waited past its 0.5 s timeout for 10 s"
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        assert len(failed) == 1 and isinstance(failed[0], BrokerUnavailable), failed
        assert "did not answer" in str(failed[0]) and "within 0.5 s" in str(failed[0]), failed
        assert 0.4 < took < 5, took
        assert np.from_dlpack(c.get("x")).tolist() == [0, 1, 2, 3]
        c.delete("x")


@pytest.mark.parametrize("timeout", [math.inf, 1e300, None], ids=["inf", "1e300", "None"])
def test_forever_is_forever_for_get_and_get_many(broker: BrokerProc, timeout: float | None) -> None:
    with broker.client() as c, broker.client() as producer:
        got: list[object] = []

        def read() -> None:
            got.append(c.get("late", timeout=timeout).version)
            got.append(sorted(c.get_many(["late", "later"], timeout=timeout)))

        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: producer.stat().waiting == 1, 5, what="the reader to wait")
        producer.put("late", np.zeros(2, dtype=np.float32))
        wait_for(
            lambda: len(got) == 1 and producer.stat().waiting == 1,
            10,
            what="the get to return and get_many to wait",
        )
        producer.put("later", np.zeros(2, dtype=np.float32))
        reader.join(10)
        assert got == [1, ["late", "later"]]
        assert c.stat().tensors == 2  # the pooled connection still works


def test_get_many_forever_sends_json(broker: BrokerProc) -> None:
    with Relay(broker.url) as relay, Client(relay.url) as c:
        c.put("x", np.zeros(1, dtype=np.float32))
        c.get_many(["x"], timeout=None)
        body = relay.requests[-1].partition(b"\r\n\r\n")[2]
        parsed = json.loads(body, parse_constant=lambda s: pytest.fail(f"not JSON: {s}"))
        assert parsed["timeout"] is None


@pytest.mark.parametrize(
    "bad,exc",
    [
        (math.nan, InvalidRequest),
        (-1, InvalidRequest),
        ("5", InvalidType),
        ([], InvalidType),
        (True, InvalidType),
    ],
    ids=["nan", "negative", "str", "list", "bool"],
)
def test_bad_timeouts_are_refused(broker: BrokerProc, bad: object, exc: type[Exception]) -> None:
    with broker.client() as c:
        c.put("x", np.zeros(1, dtype=np.float32))
        for call in (
            lambda: c.get("x", timeout=bad),  # type: ignore[arg-type]
            lambda: c.get_many(["x"], timeout=bad),
        ):  # type: ignore[arg-type]
            with pytest.raises(exc, match="timeout"):
                call()
        assert c.stat().leases == 0


# -- get_many: one deadline, nothing granted after the client gave up ------------------------------


def test_get_many_has_one_deadline(broker: BrokerProc) -> None:
    with broker.client() as c, broker.client() as producer:
        done: list[object] = []
        t0 = time.monotonic()

        def read() -> None:
            try:
                done.append(c.get_many(["x", "y"], timeout=1.0))
            except TensorNotFound as exc:
                done.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: time.monotonic() - t0 > 0.6, 2, interval=0.01, what="0.6 s")
        producer.put("x", np.zeros(1, dtype=np.float32))  # inside the deadline
        wait_for(lambda: time.monotonic() - t0 > 1.3 or done, 3, interval=0.01, what="1.3 s")
        producer.put("y", np.zeros(1, dtype=np.float32))  # past the batch's one deadline
        reader.join(10)
        assert isinstance(done[0], TensorNotFound), f"the batch waited past its deadline: {done[0]}"
        assert time.monotonic() - t0 < 2.5
        wait_for(lambda: producer.stat().leases == 0, 5, what="no lease left from the failed batch")


def test_publish_many_is_all_or_nothing(broker: BrokerProc) -> None:
    with broker.client() as c:
        body = {"names": ["p", "q"], "shapes": [[2], [2]], "dtypes": ["float32"] * 2}
        vs = c._call("POST", "/v1/many/alloc", body, rid=c._rid())["versions"]
        bad = {"names": ["p", "q"], "versions": [vs[0], 99]}
        with pytest.raises(TensorNotFound, match="given back: put the batch again"):
            c._call("POST", "/v1/many/publish", bad, rid=c._rid())
        # Nothing of it is published, and what it named is given back (q's own
        # allocation, which it did not name, is still being written).
        assert {i.name: i.state for i in c.list()} == {"q": "writing"}
        good = {"names": ["p", "q"], "versions": vs}
        with pytest.raises(TensorNotFound):  # p is gone: the whole batch is refused
            c._call("POST", "/v1/many/publish", good, rid=c._rid())
        assert c.list() == [] and c.stat().bytes_in_use == 0
        vs = c._call("POST", "/v1/many/alloc", body, rid=c._rid())["versions"]
        c._call("POST", "/v1/many/publish", {"names": ["p", "q"], "versions": vs}, rid=c._rid())
        assert sorted(i.name for i in c.list() if i.state == "ready") == ["p", "q"]


def test_put_of_a_tensor_from_a_dead_broker_copies_it(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """A lease id from before a broker restart may name another lease now: a
    re-put of such a tensor copies its bytes, it never links by that id."""
    b = broker_factory()
    with b.client() as c:
        c.put("old", np.full(1000, 3.0, dtype=np.float32))
        stale = c.get("old")
        b.kill()
        b.start()
        c.put("other", np.full(1000, 8.0, dtype=np.float32))
        other = c.get("other")  # a lease of the new session, probably with the same id
        assert c.put("copy", stale) == 1
        assert np.array_equal(np.from_dlpack(c.get("copy")), np.full(1000, 3.0, dtype=np.float32))
        del stale, other


@pytest.mark.parametrize("target", ["/v1/nope", "/v1/sessions//heartbeat"])
def test_a_refused_request_with_a_small_body_is_answered_on_a_live_connection(
    broker: BrokerProc, target: str
) -> None:
    """A POST with a JSON body to a route that does not exist: the broker reads
    the small body before answering, so the answer is never lost to a reset
    (closing a socket with unread bytes resets it), and the connection stays
    open for the next request."""
    body = json.dumps({"x": "y" * 300}).encode()
    request = encode("POST", target, [("content-type", "application/json")], body)
    for _ in range(40):
        sock = connect(broker.sock, 10)
        try:
            sock.sendall(request)
            reader = _Reader(sock)
            assert read_answer(reader, "POST").status in (400, 404)
            sock.sendall(encode("GET", "/healthz", []))
            assert read_answer(reader, "GET").status == 200
        finally:
            sock.close()
