"""Broker state stays bounded by live work, and slow work stays off the event
loop (README, Lifetime: M5, M7), against a real broker process."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, run_worker, wait_for
from tensordepot import Client, LimitExceeded, TensorNotFound

MiB = 1 << 20


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _raw(path: str, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes to the broker's socket; return what it answers before closing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed while we were still sending: read the answer
        out = b""
        try:
            while not _whole(out) and (chunk := s.recv(65536)):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return out


def _whole(answer: bytes) -> bool:
    """Whether ``answer`` holds a whole response (its head and the body its
    Content-Length announces): a connection kept alive is not closed after it."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def test_timed_out_waits_leave_nothing_behind(broker: BrokerProc) -> None:
    """Every wait on a name nobody publishes times out; the broker keeps no
    state for any of them (it used to keep one event per name forever, and
    then an empty entry per request in the session, for the session's life:
    so the waits share one long-lived session here)."""
    assert broker.proc is not None
    with broker.client() as c, broker.client() as w:
        c.put("warm", np.zeros(4, dtype=np.float32))

        def many(k: int) -> None:
            for i in range(1500):
                with pytest.raises(TensorNotFound):
                    w.get(f"absent-{k}-{i}", timeout=0.001)

        for k in range(2):  # warm every code path and allocator before measuring
            many(100 + k)
        before = _rss_kib(broker.proc.pid)
        threads = [threading.Thread(target=many, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        after = _rss_kib(broker.proc.pid)
        assert c.stat().waiting == 0
        assert after - before < 1024, (
            f"6000 timed-out waits grew the broker by {after - before} KiB"
        )


def test_sessions_per_process_are_limited(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory("--max-sessions-per-peer", "8")
    clients = [b.client() for _ in range(7)]  # +1: the fixture's own probe may come from this pid
    try:
        with pytest.raises(LimitExceeded, match="--max-sessions-per-peer"):
            for _ in range(5):
                clients.append(b.client())
        res = run_worker("consumer_ping", b.url)  # another process is served as before
        assert "pong" in res.stdout
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("what", ["head", "release ids", "body"])
def test_oversized_requests_are_refused_without_reading_them(broker: BrokerProc, what: str) -> None:
    assert broker.proc is not None
    before = _rss_kib(broker.proc.pid)
    path = broker.sock
    if what == "head":
        out = _raw(
            path, b"GET /v1/stat HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (16 * MiB) + b"\r\n\r\n"
        )
        assert out.startswith(b"HTTP/1.1 431"), out[:200]
    elif what == "release ids":
        ids = ",".join(str(i) for i in range(5000)).encode()
        out = _raw(
            path,
            b"GET /v1/stat HTTP/1.1\r\nHost: x\r\nx-tensordepot-session: s\r\n"
            b"x-tensordepot-release: " + ids + b"\r\n\r\n",
        )
        assert out.startswith(b"HTTP/1.1 400"), out[:200]
        assert b"at most 4096" in out
    else:
        body = b"[" + b"1," * (32 * MiB) + b"1]"
        out = _raw(
            path,
            b"POST /v1/release HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
        )
        assert out.startswith(b"HTTP/1.1 413"), out[:200]
    err = json.loads(out.partition(b"\r\n\r\n")[2])["error"]
    assert err["message"], err
    grown = _rss_kib(broker.proc.pid) - before
    assert grown < 8 * 1024, f"the broker read {grown} KiB of a request it refuses"
    with broker.client() as c:  # and it keeps serving
        assert c.stat().sessions >= 1


def test_idle_connections_cannot_starve_new_clients(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    b = broker_factory("--max-connections", "64")
    idle: list[socket.socket] = []
    try:
        for _ in range(300):  # far more idle keep-alive connections than the limit
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(b.sock)
            idle.append(s)
        t0 = time.monotonic()
        with Client(b.url, timeout=10) as c:
            c.put("x", np.zeros(4, dtype=np.float32))
            assert c.get("x").version == 1
        assert time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()


def test_a_big_first_put_does_not_stall_other_clients(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """While one client creates (fallocate: about 1 s per GiB) and fills a 1 GiB
    segment, another client's gets keep their latency: p99 under 20 ms, a bound
    a broker that pre-faults on its event loop cannot meet."""
    b = broker_factory(max_memory="3GiB")
    with b.client() as c:
        c.put("small", np.zeros(256, dtype=np.float32))
        stop = threading.Event()
        lat: list[float] = []

        def getter() -> None:
            with b.client() as g:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    t = g.get("small")
                    lat.append(time.perf_counter() - t0)
                    del t

        th = threading.Thread(target=getter)
        th.start()
        try:
            wait_for(lambda: len(lat) > 50, 10, what="the getter to run")
            start = len(lat)
            res = run_worker("big_put", b.url, "1024")  # another process: a cold 1 GiB put
            assert "put" in res.stdout
            during = lat[start:]
        finally:
            stop.set()
            th.join(30)
        assert len(during) > 20, "too few gets during the put to judge"
        p99 = statistics.quantiles(during, n=100)[98]
        assert p99 < 0.020, (
            f"gets stalled while a segment was made: p99 {p99 * 1000:.1f} ms "
            f"over {len(during)} gets"
        )
        c.delete("big")


def test_leases_per_session_are_limited(broker_factory: Callable[..., BrokerProc]) -> None:
    """A session that gets without releasing is refused past
    --max-leases-per-session (429), taking nothing; releasing makes room.
    (Put one by one: a get_many of one put_many's small tensors, a pack,
    takes a single lease.)"""
    b = broker_factory("--max-leases-per-session", "100")
    with b.client() as c:
        names = [f"l{i}" for i in range(60)]
        for n in names:
            c.put(n, np.zeros(4, np.float32))
        first = c.get_many(names)
        with pytest.raises(LimitExceeded, match="--max-leases-per-session"):
            c.get_many(names)
        assert c.stat().leases == 60, "the refused batch took leases"
        held = [c.get("l0") for _ in range(40)]
        with pytest.raises(LimitExceeded, match="release what you no longer read"):
            c.get("l1")
        del first, held
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to be released")
        again = c.get_many(names)  # room again
        assert len(again) == 60
        del again
        c.delete(prefix="l")
    b.check_clean()
