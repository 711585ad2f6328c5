"""The shared-memory lane (docs/plan-lane.md), through a real broker: the
handover of its memfd and bells on the unix socket, requests on it that
answer as over HTTP, the places it is refused, its descriptors given back
with its session, and a client that writes garbage into it.

The lane serves ``stat`` so far (step 1 of the plan); every other route
is answered 400 on it and keeps HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _harness import BrokerProc, drained, in_pid_namespace, stat_when, wait_for
from _rawhttp import Session, encode, exchange
from _rawlane import RawLane, answered, handover, lane_fds
from _users import User, group_dir, other_user
from tensordepot._laneproto import request_record
from tensordepot._proto import SESSION_HEADER
from tensordepot.service._http._shmlane import ANSWERS, REQUESTS
from tensordepot.shm._lanemem import PAGE
from tensordepot.shm._ring import HEADER

ACCOUNTS = ("bytes_in_use", "tensors", "versions", "leases", "sessions", "waiting")


def _fds_back(b: BrokerProc, base: int) -> None:
    assert b.proc is not None
    pid = b.proc.pid
    wait_for(lambda: lane_fds(pid) == base, what=f"the broker back to {base} lane descriptors")


def test_stat_on_the_lane_answers_as_over_http(broker: BrokerProc) -> None:
    """A request on the lane gets the answer, error code and effect it gets
    over HTTP, runs through the same gate (counted in the route metrics),
    and a route the lane does not serve is refused there, doing nothing."""
    with broker.client() as c:
        c.put("keep", np.arange(4, dtype=np.float32))
    raw = Session(broker.sock)
    status, info, fds = handover(broker.sock, raw.sid)
    assert (status, info, len(fds)) == (200, {"requests": REQUESTS, "answers": ANSWERS}, 4)
    lane = RawLane(fds)
    try:
        for _ in range(2):
            before = answered(broker, "GET", "/v1/stat")
            on_lane = lane.call("GET", "/v1/stat")
            over_http = raw.send("GET", "/v1/stat")
            assert on_lane[0] == over_http[0] == 200
            assert {k: on_lane[1][k] for k in ACCOUNTS} == {k: over_http[1][k] for k in ACCOUNTS}
            assert set(on_lane[1]) == set(over_http[1])
            assert answered(broker, "GET", "/v1/stat") == before + 2, "the lane's is counted"
        for method, target in [("GET", "/nope"), ("PUT", "/v1/stat"), ("GET", "/v1/stat/x")]:
            got, http = lane.call(method, target), raw.send(method, target)
            assert (got[0], got[1]["error"]["code"]) == (http[0], http[1]["error"]["code"]), target
        status, answer = lane.call("DELETE", "/v1/tensors/keep")
        assert status == 400 and "over HTTP" in answer["error"]["message"], answer
        with broker.client(lane=False) as c:
            assert [t.name for t in c.list()] == ["keep"], "the refused request did nothing"
    finally:
        lane.close()
    with broker.client() as c:
        st = c.stat()
        assert c._core.lane is not None, "the client's stat went on its lane"
        with broker.client(lane=False) as h:
            over_http = h.stat()
            assert h._core.lane is None
        assert {k: getattr(st, k) for k in ACCOUNTS if k != "sessions"} == {
            k: getattr(over_http, k) for k in ACCOUNTS if k != "sessions"
        }
        c.delete("keep")
    raw.close()
    drained(broker, "leases", "bytes_in_use", sessions=1)


def test_a_get_on_the_lane_answers_as_over_http(broker: BrokerProc) -> None:
    """A get on the lane (the newest, by version, newer than, a name never
    put, a version gone) gets the answer, error code and lease that the same
    get gets over HTTP; its lease rides back as over HTTP; a Client's gets
    go on its lane, with the right bytes."""
    x = np.arange(256, dtype=np.float32)
    with broker.client(lane=False) as c:
        c.put("g", x)
        c.put("g", x + 1)
    raw = Session(broker.sock)
    _, _, fds = handover(broker.sock, raw.sid)
    lane = RawLane(fds)
    try:
        for target in [
            "/v1/tensors/g",
            "/v1/tensors/g?version=2",
            "/v1/tensors/g?newer_than=1",
            "/v1/tensors/g?version=1",
            "/v1/tensors/nope",
            "/v1/tensors/g?newer_than=2",
            "/v1/tensors/g?version=x",
        ]:
            before = broker.stat().leases
            on_lane = lane.call("GET", target)
            mid = broker.stat().leases
            over_http = raw.send("GET", target)
            after = broker.stat().leases
            assert on_lane[0] == over_http[0], (target, on_lane, over_http)
            assert mid - before == after - mid, (target, "the same effect on the leases")
            if on_lane[0] == 200:
                keep = ("name", "version", "shape", "dtype", "nbytes", "segment", "offset")
                assert {k: on_lane[1][k] for k in keep} == {k: over_http[1][k] for k in keep}
                for lid in (on_lane[1]["lease"], over_http[1]["lease"]):
                    assert raw.send("POST", "/v1/release", {"leases": [lid]})[0] == 200
            else:
                assert on_lane[1]["error"]["code"] == over_http[1]["error"]["code"], target
        assert broker.stat().leases == 0
    finally:
        lane.close()
    raw.close()
    with broker.client() as c:
        t = c.get("g")
        assert c._core.lane is not None and np.array_equal(np.from_dlpack(t), x + 1)
        assert np.array_equal(np.from_dlpack(c.get("g", newer_than=1)), x + 1)
        del t
        c.delete("g")
    drained(broker, "leases", "bytes_in_use", sessions=1)


def test_a_put_on_the_lane_answers_as_over_http(broker: BrokerProc) -> None:
    """A put with its bytes inline on the lane (good, a wrong byte count, a
    bad dtype, a bad name, one whose request id was seen) gets the answer,
    error code and effect on the accounting that it gets over HTTP; a
    Client's small puts go on its lane, a larger one (past the ring) over
    HTTP, each with its bytes."""
    raw = Session(broker.sock)
    _, _, fds = handover(broker.sock, raw.sid)
    lane = RawLane(fds)
    four = np.arange(4, dtype=np.float32).tobytes()
    cases = [
        ("/v1/put/p.{door}?dtype=float32&shape=4", four, ()),
        ("/v1/put/p.{door}?dtype=float32&shape=4", four[:-1], ()),
        ("/v1/put/p.{door}?dtype=nope&shape=4", four, ()),
        ("/v1/put/p.{door}?dtype=float32&shape=-4", four, ()),
        ("/v1/put/%00p.{door}?dtype=float32&shape=4", four, ()),
        ("/v1/put/r.{door}?dtype=float32&shape=4", four, (("x-tensordepot-request", "r1"),)),
        ("/v1/put/r.{door}?dtype=float32&shape=4", four, (("x-tensordepot-request", "r1"),)),
    ]
    try:
        for target, body, extra in cases:
            seen = {}
            for door in ("lane", "http"):
                before = broker.stat()
                t = target.format(door=door)
                if door == "lane":
                    lane.seq += 1
                    rec = request_record(
                        lane.seq, "POST", t, [(k.encode(), v.encode()) for k, v in extra], body
                    )
                    assert lane.mem.requests.put(rec)  # type: ignore[union-attr]
                    lane.mem.ring(0)
                    got = lane.answer()
                    assert got is not None and got[0] == lane.seq
                    status, answer = got[1], json.loads(got[2])
                else:
                    hs = [(SESSION_HEADER, raw.sid), *extra]
                    a = exchange(broker.sock, encode("POST", t, hs, body))
                    status, answer = a.status, a.json()
                after = broker.stat()
                delta = tuple(getattr(after, k) - getattr(before, k) for k in ACCOUNTS)
                code = answer["error"]["code"] if status >= 400 else answer["version"]
                seen[door] = (status, code, delta)
            assert seen["lane"] == seen["http"], (target, seen)
    finally:
        lane.close()
    raw.close()
    x = np.arange(1000, dtype=np.float64)
    big = np.arange(20_000, dtype=np.float64)  # 160 KB: inline, on the lane too
    with broker.client() as c:
        c.put("small", x)
        c.put("big", big)
        assert c._core.lane is not None
        assert np.array_equal(np.from_dlpack(c.get("small")), x)
        assert np.array_equal(np.from_dlpack(c.get("big")), big)
        c.delete_many(["small", "big", "p.lane", "p.http", "r.lane", "r.http"])
    drained(broker, "leases", "bytes_in_use", sessions=1)


def test_no_lane_where_it_cannot_be_passed(
    broker_factory: Callable[..., BrokerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No lane from a broker started with --no-lane ($TENSORDEPOT_NO_LANE),
    for a session that is not the caller's, or to a client with lane=False
    ($TENSORDEPOT_LANE=0), which never asks: each keeps HTTP and works.
    (Over TCP the route answers 400 at every door: tests/e2e/test_doors.py.)"""
    for off in (broker_factory("--no-lane"), broker_factory(env={"TENSORDEPOT_NO_LANE": "1"})):
        raw = Session(off.sock)
        status, answer, fds = handover(off.sock, raw.sid)
        assert (status, answer["error"]["code"], fds) == (409, "conflict", []), answer
        assert "--no-lane" in answer["error"]["message"]
        with off.client() as c:
            assert c.stat().sessions == 2 and c._core.lane is None
        raw.close()
    b = broker_factory()
    status, answer, fds = handover(b.sock, "not-a-session")
    assert (status, answer["error"]["code"], fds) == (409, "unknown_session", []), answer
    asked = answered(b, "POST", "/v1/lane")
    with b.client(lane=False) as c:
        c.stat()
        assert c._core.lane is None
    monkeypatch.setenv("TENSORDEPOT_LANE", "0")
    with b.client() as c:
        c.stat()
        assert c._core.lane is None
    assert answered(b, "POST", "/v1/lane") == asked, "a client without a lane never asks"
    monkeypatch.delenv("TENSORDEPOT_LANE")
    with b.client() as c:
        c.stat()
        assert c._core.lane is not None
    assert answered(b, "POST", "/v1/lane") == asked + 1


_HOLDER = """
import sys, time
from tensordepot import Client
from tensordepot._laneproto import request_record
from tensordepot._proto import SESSION_HEADER
c = Client(sys.argv[1])
c.stat()
assert c._core.lane is not None
print("ready", flush=True)
time.sleep(120)
"""


def test_a_lanes_descriptors_go_with_its_session(broker: BrokerProc) -> None:
    """The broker's memfd and bells of a lane are closed when its session
    ends: the client closes, or its process is killed (-9)."""
    assert broker.proc is not None
    pid = broker.proc.pid
    with broker.client(lane=False) as watcher:
        base = lane_fds(pid)
        c = broker.client()
        c.stat()
        assert c._core.lane is not None and lane_fds(pid) >= base + 3
        c.close()
        _fds_back(broker, base)
        with subprocess.Popen(
            [sys.executable, "-c", _HOLDER, broker.url], stdout=subprocess.PIPE, text=True
        ) as p:
            try:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                assert lane_fds(pid) >= base + 3 and watcher.stat().sessions == 2
            finally:
                p.kill()
        _fds_back(broker, base)
        assert watcher.stat().sessions == 1
    drained(broker, "leases", sessions=1)


_WAITER = """
import sys
import numpy as np
from tensordepot import Client
c = Client(sys.argv[1])
held = np.from_dlpack(c.get("w"))  # a lease
assert c._core.lane is not None
print("ready", flush=True)
if sys.argv[2] == "get":
    c.get("never", timeout=120)  # parked on the lane when it is killed
else:
    c.get_many(["w", "never"], timeout=120)
"""


@pytest.mark.parametrize("op", ["get", "get_many"])
def test_a_client_killed_mid_request_leaves_nothing(broker: BrokerProc, op: str) -> None:
    """A client killed (-9) while its get (or get_many) waits on the lane,
    holding a lease: its wait, its lease, its session and the lane's
    descriptors are all gone from the broker, which serves the next client
    on its lane."""
    assert broker.proc is not None
    pid = broker.proc.pid
    with broker.client(lane=False) as watcher:
        watcher.put("w", np.arange(16))
        base = lane_fds(pid)
        with subprocess.Popen(
            [sys.executable, "-c", _WAITER, broker.url, op], stdout=subprocess.PIPE, text=True
        ) as p:
            try:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                stat_when(watcher, lambda st: st.waiting == 1, "the get to wait on the lane")
                # (a get_many leases what it found before it waits for the rest)
                held = 1 if op == "get" else 2
                assert watcher.stat().leases == held and lane_fds(pid) >= base + 3
            finally:
                p.kill()
        _fds_back(broker, base)
        drained(watcher, "waiting", "leases", sessions=1)
        with broker.client() as c:
            assert int(np.from_dlpack(c.get("w"))[15]) == 15 and c._core.lane is not None
        watcher.delete("w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def _scribble(lane: RawLane, what: str) -> None:
    """Write into the request ring what no client writes (``what``), as a
    client owns those bytes and may; then ring the bell."""
    m = lane.mem._map
    tail_at, data = PAGE + 64, PAGE + HEADER
    tail = struct.unpack_from("<Q", m, tail_at)[0]
    at = tail % REQUESTS
    if what == "tail-past-the-end":
        struct.pack_into("<Q", m, tail_at, tail + (1 << 40))
    elif what == "tail-backwards":
        struct.pack_into("<Q", m, tail_at, tail - 8)
    elif what == "huge-length":
        struct.pack_into("<II", m, data + at, 0x7FFFFFF0, 0)
        struct.pack_into("<Q", m, tail_at, tail + 16)
    elif what == "cut-in-half":
        struct.pack_into("<II", m, data + at, 100, 0)
        struct.pack_into("<Q", m, tail_at, tail + 56)
    elif what == "random-bytes":
        junk = np.random.default_rng(5).integers(0, 256, 200, dtype=np.uint8).tobytes()
        struct.pack_into("<II", m, data + at, len(junk), 0)
        m[data + at + 8 : data + at + 8 + len(junk)] = junk
        struct.pack_into("<Q", m, tail_at, tail + 8 + len(junk))
    lane.mem.ring(0)


GARBAGE = ["tail-past-the-end", "tail-backwards", "huge-length", "cut-in-half", "random-bytes"]


@pytest.mark.parametrize("what", GARBAGE)
def test_a_garbled_lane_ends_only_its_session(broker: BrokerProc, what: str) -> None:
    """A client that writes what no client writes into its lane loses its
    session, with one line in the broker's log; meanwhile another client
    gets the right bytes on its own lane, before and after, and the broker
    gives the garbled lane's descriptors back."""
    assert broker.proc is not None
    x = np.arange(1024, dtype=np.float32)
    with broker.client() as c:
        c.put("keep", x)
        assert np.array_equal(np.from_dlpack(c.get("keep")), x) and c._core.lane is not None
        base = lane_fds(broker.proc.pid)
        raw = Session(broker.sock)
        _, _, fds = handover(broker.sock, raw.sid)
        lane = RawLane(fds)
        assert lane.call("GET", "/v1/stat")[0] == 200
        assert c.stat().sessions == 2
        _scribble(lane, what)
        wait_for(lambda: c.stat().sessions == 1, what="the garbling session ended")
        assert lane.answer(timeout=0.2) is None
        assert lane.mem.gone(), "the broker marked the lane gone"
        lane.close()
        _fds_back(broker, base)
        lines = [ln for ln in broker.log().splitlines() if "garbage into its lane" in ln]
        assert len(lines) == 1 and raw.sid in lines[0], lines
        for _ in range(3):
            assert np.array_equal(np.from_dlpack(c.get("keep")), x), "the broker keeps serving"
        assert c._core.lane is not None, "the other client's lane goes on"
        c.delete("keep")
    drained(broker, "leases", "bytes_in_use", sessions=1)


def test_a_client_that_reads_no_answers_ends_only_its_session(broker: BrokerProc) -> None:
    """A client that sends request after request and never takes an answer
    fills its answer ring: the broker does not wait for it (it never blocks
    on a client), ends that session with one log line, and keeps serving."""
    raw = Session(broker.sock)
    _, _, fds = handover(broker.sock, raw.sid)
    lane = RawLane(fds)
    with broker.client(lane=False) as c:
        for _ in range(2 * ANSWERS // 200):  # about 200 bytes of answer each: twice the ring
            lane.seq += 1
            assert lane.mem.requests.put(request_record(lane.seq, "GET", "/v1/stat", [], b""))  # type: ignore[union-attr]
        lane.mem.ring(0)
        wait_for(lambda: c.stat().sessions == 1, what="the session that reads nothing ended")
        log = broker.log()
        lines = [ln for ln in log.splitlines() if "answer ring is full" in ln]
        assert len(lines) == 1 and raw.sid in lines[0], lines
        assert "Traceback" not in log and "Exception in callback" not in log, log
        assert c.stat().sessions == 1
    lane.close()


def test_a_bell_with_no_record_costs_nothing(broker: BrokerProc) -> None:
    """A bell rung with nothing in the ring, ten thousand times, ends no
    session and leaves the broker idle: it reads the bell, finds nothing,
    and waits again (it does not spin)."""
    assert broker.proc is not None
    raw = Session(broker.sock)
    _, _, fds = handover(broker.sock, raw.sid)
    lane = RawLane(fds)
    for _ in range(10_000):
        lane.mem.ring(0)
    assert lane.call("GET", "/v1/stat")[0] == 200, "the lane still answers"
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        with open(f"/proc/{broker.proc.pid}/stat") as f:  # type: ignore[union-attr]
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    t0, w0 = cpu(), time.monotonic()
    time.sleep(1.0)  # measuring an idle broker: a span of time is the point
    used = (cpu() - t0) / (time.monotonic() - w0)
    assert used < 0.2, f"the broker used {used:.0%} of a core with nothing to do"
    assert lane.call("GET", "/v1/stat")[1]["sessions"] == 1
    lane.close()
    raw.close()


@pytest.fixture(scope="module")
def other() -> Iterator[User]:
    yield from other_user()


_THIEF = """
import json, socket
sock, sid = ARGS
s = socket.socket(socket.AF_UNIX)
s.connect(sock)
s.sendall(("POST /v1/lane HTTP/1.1\\r\\nHost: x\\r\\nx-tensordepot-session: " + sid
           + "\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n").encode())
data, fds, _, _ = socket.recv_fds(s, 65536, 4)
while True:
    more = s.recv(65536)
    if not more:
        break
    data += more
emit([int(data.split(b" ", 2)[1]), len(fds), json.loads(data.partition(b"\\r\\n\\r\\n")[2])])
"""


def test_another_uid_gets_no_lane_of_ours(
    other: User, broker_factory: Callable[..., BrokerProc]
) -> None:
    """A second uid the broker admits may open sessions of its own, but a
    lane goes only to its session's owner: asked for root's session, it is
    refused and gets no descriptor."""
    b = broker_factory(
        "--allow-uid", other.name, "--shm-group", other.group, sock_dir=group_dir(other.group_gid)
    )
    raw = Session(b.sock)
    [(status, nfds, answer)] = other.emits(_THIEF, b.sock, raw.sid)
    assert (status, nfds) == (403, 0), answer
    assert answer["error"]["code"] == "forbidden"
    with b.client() as c:
        assert c.stat().sessions == 2
    raw.close()
    assert json.dumps(answer)  # the one error body


_FORKER = """
import os, sys
from tensordepot import Client
with Client(sys.argv[1]) as c:
    c.stat()
    parents = c._core.lane
    assert parents is not None
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if all holds
        ok = False
        try:
            st = c.stat()
            mine = c._core.lane
            ok = (
                st.sessions == 2
                and mine is not None
                and mine is not parents
                and mine.pid == os.getpid()
                and parents.closed
            )
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child used its parent's lane"
    assert c._core.lane is parents and not parents.closed
    c.stat()
print("ok")
"""


def test_a_forked_child_asks_its_own_lane(broker: BrokerProc) -> None:
    """A forked child never uses its parent's lane: it closes its copies of
    the parent's descriptors, and its session asks a lane of its own.  (In
    a process of its own: this one has threads, and fork() warns.)"""
    out = subprocess.run(
        [sys.executable, "-c", _FORKER, broker.url], capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr
    drained(broker, "leases", sessions=1)


_IN_FLIGHT = """
import os, signal, sys, threading, time, warnings
import numpy as np
from tensordepot import Client
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with a thread: what this tests
with Client(sys.argv[1]) as c, Client(sys.argv[1], lane=False) as w:
    c.stat()
    lane = c._core.lane
    got = {}
    if sys.argv[2] == "get":
        wait = lambda: got.update(t=c.get("late", timeout=30))
    else:
        wait = lambda: got.update(t=c.get_many(["late", "late2"], timeout=30)["late"])
    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 10
    while not lane._lock.locked():  # the get waits on the lane, holding it
        assert time.monotonic() < deadline, "the get never went on the lane"
        time.sleep(0.001)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if all holds
        ok = False
        try:
            c.put("child", np.arange(4))
            t = c.get("child")
            mine = c._core.lane
            ok = (
                int(np.from_dlpack(t)[3]) == 3
                and mine is not None
                and mine is not lane
                and mine.pid == os.getpid()
            )
            del t
            c.delete("child")
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:  # stuck on its parent's lane: killed, and a failure
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child could not use a lane of its own"
    w.put_many({"late": np.full(8, 5.0), "late2": np.full(8, 6.0)})
    waiter.join(30)
    assert float(np.from_dlpack(got.pop("t"))[0]) == 5.0, "the parent's get lost its answer"
    assert c._core.lane is lane and not lane.closed
    w.delete_many(["late", "late2"])
print("ok")
"""


@pytest.mark.parametrize("op", ["get", "get_many"])
def test_a_fork_with_a_request_in_flight(broker: BrokerProc, op: str) -> None:
    """A process forks while another of its threads waits for a get (or a
    get_many) on the lane: the child (whose copy of the lane is held by a
    thread it does not have) puts and gets on a lane of its own; the
    parent's get gets its answer when the names are put; nothing is left
    held."""
    out = subprocess.run(
        [sys.executable, "-c", _IN_FLIGHT, broker.url, op],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr
    drained(broker, "leases", "bytes_in_use", "tensors", "waiting", sessions=1)


_PAUSED = """
import sys
import numpy as np
from tensordepot import Client
c = Client(sys.argv[1])
held = np.from_dlpack(c.get("a"))
first = c._core.lane
assert first is not None
print("ready", flush=True)
sys.stdin.readline()  # after the pause
again = np.from_dlpack(c.get("a"))  # over HTTP: the lane is gone, the session too
c.stat()  # the new session's first call that may go on a lane asks for one
lane = c._core.lane
print("ok", int(again[0]), int(held[0]), lane is not None and lane is not first, flush=True)
sys.stdin.readline()
"""


_PAUSED_WAITING = """
import sys
import numpy as np
from tensordepot import Client
c = Client(sys.argv[1])
c.stat()
first = c._core.lane
assert first is not None
print("ready", flush=True)
got = c.get_many(["late", "late2"], timeout=60)  # on the lane, then over HTTP
print("ok", int(np.from_dlpack(got["late"])[0]), int(np.from_dlpack(got["late2"])[0]),
      c._core.lane is not first, flush=True)
del got
sys.stdin.readline()
"""


@contextlib.contextmanager
def _ttl_broker(broker_factory: Callable[..., BrokerProc]) -> Iterator[BrokerProc]:
    """A broker with --session-ttl 1 in a pid namespace of its own, where
    it cannot see its clients' pids (they live on heartbeats); stopped at
    the end with its segments gone.  Skips where no namespace can be made."""
    launcher = in_pid_namespace()
    if launcher is None:
        pytest.skip("needs root and unshare --pid to put the broker in another pid namespace")
    b = broker_factory("--session-ttl", "1", launcher=launcher)
    assert b.proc is not None
    try:
        yield b
    finally:  # unshare --fork ignores SIGTERM: the broker, its child, is stopped here
        kids = subprocess.run(["pgrep", "-P", str(b.proc.pid)], capture_output=True, text=True)
        for kid in kids.stdout.split():
            os.kill(int(kid), signal.SIGTERM)
        code = b.proc.wait(30)
    assert code == 0 and b.segments() == [], b.log()
    b.stop()  # (closes its log)
    b.expect_dead = True  # type: ignore[attr-defined]  # stopped here: its checks are above


@contextlib.contextmanager
def _client_running(b: BrokerProc, script: str) -> Iterator[subprocess.Popen[str]]:
    """``script`` in a process of its own, given the broker's URL, its stdin
    and stdout pipes; told "exit" at the end, which it must obey."""
    with subprocess.Popen(
        [sys.executable, "-c", script, b.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as p:
        assert p.stdin is not None and p.stdout is not None
        try:
            yield p
            p.stdin.write("exit\n")
            p.stdin.flush()
            assert p.wait(30) == 0
        finally:
            p.kill()


def test_a_get_many_waiting_on_a_lane_paused_past_its_ttl_is_answered(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """A client SIGSTOPped past --session-ttl while its get_many waits on
    the lane: its session lapses and its lane closes, with the wait.  On
    SIGCONT its wait finds the lane gone and asks again over HTTP under a
    new session, and is answered with the right bytes when the names are
    put; nothing is left once it exits."""
    with _ttl_broker(broker_factory) as b:
        with b.client(lane=False) as c:
            with _client_running(b, _PAUSED_WAITING) as p:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                stat_when(c, lambda s: s.waiting == 1, "the get_many to wait on the lane")
                p.send_signal(signal.SIGSTOP)
                stat_when(
                    c,
                    lambda s: (s.sessions, s.waiting) == (1, 0),
                    "the paused session to lapse",
                    15,
                )
                p.send_signal(signal.SIGCONT)
                stat_when(
                    c,
                    lambda s: (s.sessions, s.waiting) == (2, 1),
                    "the get_many to wait again, under a new session",
                    15,
                )
                c.put_many({"late": np.full(4, 7.0), "late2": np.full(4, 8.0)})
                assert p.stdout.readline().split() == ["ok", "7", "8", "True"]
            c.delete_many(["late", "late2"])
        drained(b, "leases", "bytes_in_use", "waiting", sessions=1)


def test_a_lane_client_paused_past_its_ttl_carries_on(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """A client whose pid the broker cannot see (the broker in a pid
    namespace of its own) lives on heartbeats.  SIGSTOP it past
    --session-ttl: its session lapses and the broker closes its lane.  On
    SIGCONT its next get finds the lane gone and goes over HTTP under a new
    session, with the right bytes; its next call asks a new lane; what it
    held stays readable; nothing is left once it exits."""
    with _ttl_broker(broker_factory) as b:
        with b.client(lane=False) as c:
            c.put("a", np.full(1024, 5.0, dtype=np.float32))
            with _client_running(b, _PAUSED) as p:
                assert p.stdin is not None and p.stdout is not None
                assert p.stdout.readline().strip() == "ready"
                assert c.stat().sessions == 2
                p.send_signal(signal.SIGSTOP)
                stat_when(c, lambda s: s.sessions == 1, "the paused session to lapse", 15)
                p.send_signal(signal.SIGCONT)
                p.stdin.write("go\n")
                p.stdin.flush()
                assert p.stdout.readline().split() == ["ok", "5", "5", "True"]
            c.delete("a")
        drained(b, "leases", "bytes_in_use", sessions=1)
