"""Sessions belong to whoever opened them, a claimed pid is never trusted, and
tenants are bounded: each with a second real Unix user (created by the test;
root only), against a real broker."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _harness import BrokerProc, free_port, wait_for
from _users import User, other_user

MiB = 1 << 20


@pytest.fixture(scope="module")
def other() -> Iterator[User]:
    yield from other_user()


def token_file(tmp_path: Path, lines: str) -> str:
    path = tmp_path / "tokens"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(lines)
    return str(path)


# What the other user runs: raw HTTP over TCP with its own token, naming a
# session id it learnt somehow (a log line, a shared notebook).
MEDDLE = """
import http.client, json
port, token, sid, lease = int(ARGS[0]), ARGS[1], ARGS[2], int(ARGS[3])
def call(method, path, body=None, headers=()):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    h = {"authorization": f"Bearer {token}", "content-type": "application/json", **dict(headers)}
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return [r.status, json.loads(data)["error"]["code"] if r.status >= 400 else None]
mine = {"x-tensordepot-session": sid}
emit({
    "close": call("DELETE", f"/v1/sessions/{sid}", headers=mine),
    "heartbeat": call("POST", f"/v1/sessions/{sid}/heartbeat", headers=mine),
    "release": call("POST", "/v1/release", {"leases": [lease]}, headers=mine),
    "piggyback": call("GET", "/v1/stat", headers={**mine, "x-tensordepot-release": str(lease)}),
    "fork": call("POST", f"/v1/sessions/{sid}/fork", headers=mine),
    "get": call("GET", "/v1/tensors/w", headers=mine),
})
"""


def test_someone_elses_session_is_403_and_the_owners_views_stay(
    other: User, broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(24)
    port = free_port()
    b = broker_factory(
        "--listen",
        f"http://127.0.0.1:{port}",
        "--token-file",
        token_file(tmp_path, f"{token} write name=intruder\n"),
    )
    want = np.arange(MiB // 4, dtype=np.float32)
    with b.client() as owner:
        owner.put("w", want)
        t = owner.get("w")
        view = np.from_dlpack(t)
        lease = t._lease_id()
        assert lease is not None
        [tried] = other.emits(MEDDLE, str(port), token, owner._sid, str(lease))
        for what in ("close", "heartbeat", "release", "piggyback", "fork", "get"):
            assert tried[what] == [403, "forbidden"], (what, tried)
        st = owner.stat()
        assert st.leases == 1 and st.sessions >= 1, st
        owner.delete("w")
        for i in range(4):  # churn: a range freed too early would be overwritten here
            owner.put(f"c{i}", np.full(MiB // 4, -1.0, dtype=np.float32))
        assert view.tobytes() == want.tobytes(), "the owner's view changed"
        del t, view


CLAIM_PID_1 = """
import http.client, json
port, token = int(ARGS[0]), ARGS[1]
with open("/proc/1/stat", "rb") as f:
    start = int(f.read().rsplit(b")", 1)[1].split()[19])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
h = {"authorization": f"Bearer {token}", "content-type": "application/json"}
conn.request("POST", "/v1/sessions", body=json.dumps({"pid": 1, "start_time": start}), headers=h)
info = json.loads(conn.getresponse().read())
h["x-tensordepot-session"] = info["session"]
conn.request("POST", "/v1/alloc", body=json.dumps({"name": "squat", "shape": [int(ARGS[2])],
                                                    "dtype": "uint8"}), headers=h)
r = conn.getresponse()
emit({"session": info, "alloc": r.status, "handle": json.loads(r.read())})
conn.close()
"""


def test_a_claimed_pid_1_gets_a_heartbeat_session_and_loses_its_allocation(
    other: User, broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(24)
    port = free_port()
    b = broker_factory(
        "--listen",
        f"http://127.0.0.1:{port}",
        "--session-ttl",
        "1",
        "--segment-size",
        "16MiB",
        max_memory="96MiB",
        env={"TENSORDEPOT_TOKEN": token},
    )
    [got] = other.emits(CLAIM_PID_1, str(port), token, str(64 * MiB))  # then it exits, silent
    assert got["alloc"] == 200, got
    info = got["session"]
    assert not info["tracked"] and info["heartbeat_interval"] is not None, info
    with b.client() as c:
        wait_for(
            lambda: c.stat().bytes_in_use == 0, 10, what="the silent session's allocation to go"
        )
        st = c.stat()
        assert st.sessions == 1 and st.retired_total >= 64 * MiB, st
        # Its dedicated segment is unlinked: the memory is the owner's again.
        c.put("mine", np.zeros(64 * MiB, dtype=np.uint8))
        c.delete("mine")


QUOTA = """
import json
import numpy as np
from tensordepot import Client, OutOfMemory
url, kib = ARGS[0], 1 << 10
out = {}
# Small puts travel with the request: this user cannot map the broker's 0600 segments.
with Client(url) as a, Client(url) as b, Client(url) as c:
    a.put("t/a1", np.zeros(250 * kib, np.uint8))      # session a: 250 KiB, the token: 250 KiB
    try:
        a.put("t/a2", np.zeros(250 * kib, np.uint8))  # session a would hold 500 KiB
    except OutOfMemory as exc:
        out["session"] = str(exc)
    b.put("t/b1", np.zeros(250 * kib, np.uint8))      # the token: 500 KiB
    try:
        c.put("t/c1", np.zeros(250 * kib, np.uint8))  # the token would hold 750 KiB
    except OutOfMemory as exc:
        out["token"] = str(exc)
emit(out)
"""


def test_per_session_and_per_token_quotas_are_507(
    other: User, broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(24)
    port = free_port()
    tcp = f"http://127.0.0.1:{port}"
    b = broker_factory(
        "--listen",
        tcp,
        "--max-memory-per-session",
        "400KiB",
        "--max-memory-per-token",
        "700KiB",
        "--token-file",
        token_file(tmp_path, f"{token} write name=tenant\n"),
    )
    want = np.arange(64 << 10, dtype=np.float32)  # 256 KiB: within the limits, which bind everyone
    with b.client() as c:
        c.put("owner/w", want)
        [got] = other.emits(QUOTA, tcp, env={"TENSORDEPOT_TOKEN": token})
        assert "--max-memory-per-session" in got["session"], got
        assert "--max-memory-per-token" in got["token"] and "token:tenant" in got["token"], got
        assert np.from_dlpack(c.get("owner/w")).tobytes() == want.tobytes()
    with b.client() as c:  # the tenant's quota is not ours: another client keeps working
        c.put("owner/x", want)
        assert sorted(i.name for i in c.list()) == ["owner/w", "owner/x", "t/a1", "t/b1"]
