"""What a caller learns and what a local user can squat, tried against a real broker.

A prefix-limited token's error messages name only names it may use; a get
for a version that is not there yet says so; the broker's prefix lock
cannot be planted by another user; a token file refuses tokens that look
like comments; ``--max-connections`` holds under a burst.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, free_port, serve_once, shm_entries, wait_for
from _rawhttp import encode, exchange
from tensordepot import Client, TensorNotFound


def write_tokens(path: Path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return str(path)


def request(
    port: int, method: str, path: str, token: str, body: Any = None, session: str | None = None
) -> tuple[int, dict[str, Any]]:
    headers = [("content-type", "application/json"), ("authorization", f"Bearer {token}")]
    headers += [("x-tensordepot-session", session)] if session else []
    data = None if body is None else json.dumps(body).encode()
    got = exchange(("127.0.0.1", port), encode(method, path, headers, data), method=method)
    return got.status, got.json() if got.body else {}


# -- 1. a prefix token learns no other tenant's names ---------------------------------------


def test_a_prefix_token_is_told_only_of_names_within_its_prefix(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    team, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = write_tokens(tmp_path / "tokens", f"{admin} admin\n{team} write prefix=team-a/\n")
    port = free_port()
    b = broker_factory("--listen", f"http://127.0.0.1:{port}", "--token-file", tokens)
    with b.client() as owner:
        owner.put("team-b/ceo-salary-table", np.ones(3))
    with Client(f"http://127.0.0.1:{port}", token=team) as c:
        assert c.list() == []
        with pytest.raises(TensorNotFound) as err:
            c.get("team-a/nothing")
        assert "team-b" not in str(err.value) and "no tensors" in str(err.value)
        with pytest.raises(TensorNotFound) as err:
            c.get("team-a/nothing", timeout=0.05)
        assert "team-b" not in str(err.value), err.value
        c.put("team-a/mine", np.ones(3))
        with pytest.raises(TensorNotFound) as err:
            c.get("team-a/nothing")
        assert "known: team-a/mine)" in str(err.value), err.value
    sessions = {
        t: request(port, "POST", "/v1/sessions", t, {"pid": os.getpid()})[1]["session"]
        for t in (team, admin)
    }
    for method, path, body in (
        ("GET", "/v1/tensors/team-a/nothing", None),
        ("DELETE", "/v1/tensors/team-a/nothing", None),
        ("POST", "/v1/many/get", {"names": ["team-a/nothing"]}),
    ):
        status, answer = request(port, method, path, team, body, sessions[team])
        assert status == 404, (path, answer)
        assert "team-b" not in answer["error"]["message"], (path, answer)
        assert "known: team-a/mine" in answer["error"]["message"], (path, answer)
    status, answer = request(
        port, "GET", "/v1/tensors/team-a/nothing", admin, None, sessions[admin]
    )
    assert "team-b/ceo-salary-table" in answer["error"]["message"], answer  # admin sees all
    for t, sid in sessions.items():
        assert request(port, "DELETE", f"/v1/sessions/{sid}", t, None, sid)[0] == 204


def test_over_flight_a_prefix_token_is_told_only_of_names_within_its_prefix(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    fl = pytest.importorskip("pyarrow.flight")
    from _hosts import flight_url

    team, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = write_tokens(tmp_path / "tokens", f"{admin} admin\n{team} read prefix=team-a/\n")
    b = broker_factory("--flight", "grpc://127.0.0.1:0", "--token-file", tokens)
    with b.client() as owner:
        owner.put("team-b/ceo-salary-table", np.ones(3))
    with fl.connect(flight_url(b)) as client:

        def opts(token: str) -> Any:
            return fl.FlightCallOptions(
                headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10
            )

        for call in (
            lambda o: client.get_flight_info(fl.FlightDescriptor.for_path("team-a/nothing"), o),
            lambda o: client.do_get(fl.Ticket(b"team-a/nothing"), o).read_all(),
        ):
            with pytest.raises(fl.FlightServerError) as err:
                call(opts(team))
            assert "team-b" not in str(err.value), err.value
            with pytest.raises(fl.FlightServerError, match="team-b/ceo-salary-table"):
                call(opts(admin))


# -- 6. a get for a version that is not there yet -------------------------------------------


def test_a_get_newer_than_the_newest_says_no_newer_version_exists_yet(broker: BrokerProc) -> None:
    with broker.client() as c:
        assert c.put("w", np.ones(3)) == 1
        with pytest.raises(TensorNotFound) as err:
            c.get("w", newer_than=1, timeout=0)
        msg = str(err.value)
        assert "no version of 'w' newer than v1" in msg and "not found" not in msg, msg
        assert "the newest is v1" in msg, msg
        assert c.get("w", newer_than=0, timeout=0).version == 1


# -- 2. the prefix lock cannot be squatted -----------------------------------------------------


def serve_refused(prefix: str, sock_dir: str) -> subprocess.CompletedProcess[str]:
    """``tensordepot serve`` on ``prefix``, which must refuse to start (a broker
    that starts anyway is stopped at the deadline, and the test fails)."""
    args = [
        "--listen",
        f"unix://{sock_dir}/broker.sock",
        "--shm-prefix",
        prefix,
        "--max-memory",
        "64MiB",
        "--prealloc",
        "0",
    ]
    try:
        return serve_once(*args)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the broker started on {prefix!r}") from None


@pytest.fixture
def squat(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(a segment prefix nobody uses, a socket directory); what is left under it is removed."""
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    yield prefix, str(tmp_path)
    for entry in shm_entries(prefix):
        os.unlink(os.path.join("/dev/shm", entry))


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another uid: needs root")


@root_only
def test_a_symlink_planted_at_the_lock_path_is_not_followed(
    squat: tuple[str, str], tmp_path: Path
) -> None:
    prefix, sock_dir = squat
    target = tmp_path / "made-by-root"
    os.symlink(target, f"/dev/shm/{prefix}lock")
    res = serve_refused(prefix, sock_dir)
    assert not target.exists(), "the broker followed the symlink"
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"/dev/shm/{prefix}lock" in lines[0], res.stderr
    assert "symbolic link" in lines[0] and "remove it" in lines[0], lines


@root_only
@pytest.mark.parametrize("uid, mode", [(65534, 0o600), (0, 0o666)])
def test_a_lock_file_of_another_uid_or_writable_by_others_is_refused(
    squat: tuple[str, str], uid: int, mode: int
) -> None:
    prefix, sock_dir = squat
    path = f"/dev/shm/{prefix}lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    os.fchown(fd, uid, -1)
    try:
        res = serve_refused(prefix, sock_dir)
    finally:
        os.close(fd)
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and "remove it" in lines[0], res.stderr
    assert os.stat(path).st_uid == uid, "the squatter's file is left for its owner to see"


def test_a_second_broker_on_the_same_prefix_exits_1_with_one_line(
    broker: BrokerProc, tmp_path: Path
) -> None:
    res = serve_refused(broker.prefix, str(tmp_path))
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "another live broker" in lines[0], res.stderr
    assert broker.alive


# -- 4. --max-connections holds under a burst ---------------------------------------------


def still_open(s: socket.socket) -> bool:
    """Whether the broker has not closed ``s`` (an answer it sent before closing is read)."""
    try:
        while s.recv(4096, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    return False


def test_a_burst_of_connections_is_held_to_max_connections(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    limit, burst = 5, 60
    b = broker_factory("--max-connections", str(limit))
    socks = []
    try:
        for _ in range(burst):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(b.sock)
            socks.append(s)
        wait_for(
            lambda: sum(map(still_open, socks)) <= limit,
            10,
            what=f"the broker to keep at most {limit} of {burst} connections",
        )
        assert sum(map(still_open, socks)) >= limit - 1, "it keeps the newest ones"
    finally:
        for s in socks:
            s.close()
    with b.client() as c:  # a new client still gets in: an idle connection makes room
        c.put("w", np.ones(3))
        assert c.get("w").version == 1


# -- 3. a token that starts with '#' is refused, not read as a comment ------------------------


def test_a_token_starting_with_a_hash_is_refused_not_dropped_as_a_comment(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    hashed = "#" + secrets.token_urlsafe(24)
    bad = write_tokens(tmp_path / "bad", f"# the broker's tokens\n#\n{hashed} admin\n")
    res = serve_once("--listen", f"unix://{tmp_path}/s.sock", "--token-file", bad)
    assert res.returncode == 2, res
    assert f"{bad}, line 3" in res.stderr and "cannot start with '#'" in res.stderr, res.stderr
    assert hashed not in res.stderr
    # '#' then a space, or alone, is a comment still
    good = write_tokens(
        tmp_path / "good", f"# the broker's tokens\n  #\n\t# admin\n{hashed[1:]} admin\n"
    )
    port = free_port()
    b = broker_factory("--listen", f"http://127.0.0.1:{port}", "--token-file", good)
    with Client(f"http://127.0.0.1:{port}", token=hashed[1:]) as c:
        assert c.list() == []
    assert b.alive


# -- 5. an unauthenticated request is refused at its head, its body never read -----------------


def test_an_unauthenticated_request_is_refused_before_its_body_is_sent(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """48 TCP connections without a token each announce a 16 MiB body and send
    none of it: each gets 401 at once, so the broker buffers nothing for them
    (its RSS stays where it was), and keeps serving."""
    port = free_port()
    token = secrets.token_urlsafe(24)
    b = broker_factory("--listen", f"http://127.0.0.1:{port}", env={"TENSORDEPOT_TOKEN": token})
    pid = b.proc.pid

    def rss() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) << 10

    before = rss()
    head = (
        f"POST /v1/put/w?dtype=uint8&shape={16 << 20} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {16 << 20}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(48):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
            s.sendall(head + b"\0" * 65536)  # a little of the body, never all of it
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert rss() - before < 64 << 20, f"the broker grew by {(rss() - before) >> 20} MiB"
    finally:
        for s in socks:
            s.close()
    with Client(f"http://127.0.0.1:{port}", token=token) as c:
        assert c.list() == []
    assert b.alive
