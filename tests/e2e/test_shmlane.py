"""The shared-memory lane (docs/plan-lane.md), through a real broker: the
handover of its memfd and bells on the unix socket, requests on it that
answer as over HTTP, the places it is refused, its descriptors given back
with its session, and a client that writes garbage into it.

The lane serves ``stat`` so far (step 1 of the plan); every other route
is answered 400 on it and keeps HTTP."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _harness import BrokerProc, drained, wait_for
from _rawhttp import Session, encode, exchange
from _rawlane import RawLane, handover, open_fds
from _users import User, group_dir, other_user
from tensordepot.shm._lanemem import PAGE
from tensordepot.shm._ring import HEADER

ACCOUNTS = ("bytes_in_use", "tensors", "versions", "leases", "sessions", "waiting")
RING = 64 << 10


def _requests(b: BrokerProc, method: str, route: str) -> int:
    """Requests the broker answered on ``route``, from its /metrics."""
    text = exchange(b.sock, encode("GET", "/metrics", [])).body.decode()
    pattern = (
        rf'^tensordepot_http_request_duration_seconds_count\{{(?=[^}}]*method="{method}")'
        rf'(?=[^}}]*route="{re.escape(route)}")[^}}]*\}} (\S+)$'
    )
    return int(sum(float(m) for m in re.findall(pattern, text, re.M)))


def _fds_back(b: BrokerProc, base: int) -> None:
    assert b.proc is not None
    wait_for(lambda: open_fds(b.proc.pid) == base, what=f"the broker back to {base} descriptors")


def test_stat_on_the_lane_answers_as_over_http(broker: BrokerProc) -> None:
    """A request on the lane gets the answer, error code and effect it gets
    over HTTP, runs through the same gate (counted in the route metrics),
    and a route the lane does not serve is refused there, doing nothing."""
    with broker.client() as c:
        c.put("keep", np.arange(4, dtype=np.float32))
    raw = Session(broker.sock)
    status, info, fds = handover(broker.sock, raw.sid)
    assert (status, info, len(fds)) == (200, {"requests": RING, "answers": RING}, 3)
    lane = RawLane(fds)
    try:
        for _ in range(2):
            before = _requests(broker, "GET", "/v1/stat")
            on_lane = lane.call("GET", "/v1/stat")
            over_http = raw.send("GET", "/v1/stat")
            assert on_lane[0] == over_http[0] == 200
            assert {k: on_lane[1][k] for k in ACCOUNTS} == {k: over_http[1][k] for k in ACCOUNTS}
            assert set(on_lane[1]) == set(over_http[1])
            assert _requests(broker, "GET", "/v1/stat") == before + 2, "the lane's is counted"
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
    asked = _requests(b, "POST", "/v1/lane")
    with b.client(lane=False) as c:
        c.stat()
        assert c._core.lane is None
    monkeypatch.setenv("TENSORDEPOT_LANE", "0")
    with b.client() as c:
        c.stat()
        assert c._core.lane is None
    assert _requests(b, "POST", "/v1/lane") == asked, "a client without a lane never asks"
    monkeypatch.delenv("TENSORDEPOT_LANE")
    with b.client() as c:
        c.stat()
        assert c._core.lane is not None
    assert _requests(b, "POST", "/v1/lane") == asked + 1


_HOLDER = """
import sys, time
from tensordepot import Client
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
        base = open_fds(pid)
        c = broker.client()
        c.stat()
        assert c._core.lane is not None and open_fds(pid) >= base + 3
        c.close()
        _fds_back(broker, base)
        with subprocess.Popen(
            [sys.executable, "-c", _HOLDER, broker.url], stdout=subprocess.PIPE, text=True
        ) as p:
            try:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                assert open_fds(pid) >= base + 3 and watcher.stat().sessions == 2
            finally:
                p.kill()
        _fds_back(broker, base)
        assert watcher.stat().sessions == 1
    drained(broker, "leases", sessions=1)


def test_a_garbled_lane_ends_only_its_session(broker: BrokerProc) -> None:
    """A client that writes what no client writes into its lane (its ring's
    counter moved past the end) loses its session, with one line in the
    broker's log; the broker keeps serving everyone else, its descriptors
    given back."""
    assert broker.proc is not None
    x = np.arange(1024, dtype=np.float32)
    with broker.client(lane=False) as c:
        c.put("keep", x)
        base = open_fds(broker.proc.pid)
        raw = Session(broker.sock)
        _, _, fds = handover(broker.sock, raw.sid)
        lane = RawLane(fds)
        assert lane.call("GET", "/v1/stat")[0] == 200
        assert c.stat().sessions == 2
        struct.pack_into("<Q", lane.mem._map, PAGE + 64, 1 << 40)  # the request ring's tail
        lane.mem.ring(0)
        wait_for(lambda: c.stat().sessions == 1, what="the garbling session ended")
        assert lane.answer(timeout=0.2) is None
        assert lane.mem.gone(), "the broker marked the lane gone"
        lane.close()
        _fds_back(broker, base + 0)
        lines = [ln for ln in broker.log().splitlines() if "garbage into its lane" in ln]
        assert len(lines) == 1 and raw.sid in lines[0], lines
        assert np.array_equal(np.from_dlpack(c.get("keep")), x), "the broker keeps serving"
        c.delete("keep")
    drained(broker, "leases", "bytes_in_use", sessions=1)
    assert HEADER == 128  # the layout the scribble above assumes (shm/_ring.py)


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
data, fds, _, _ = socket.recv_fds(s, 65536, 3)
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


def test_a_forked_child_asks_its_own_lane(broker: BrokerProc) -> None:
    """A forked child never uses its parent's lane: it closes its copies of
    the parent's descriptors, and its session asks a lane of its own."""
    import os

    with broker.client() as c:
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
        assert c.stat().sessions >= 1
    drained(broker, "leases", sessions=1)
