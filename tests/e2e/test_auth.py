"""Who may do what, tried by a second real Unix user: authenticated
listeners, scoped tokens, name prefixes, and no squatting.

The module creates a throwaway user, and a group it belongs to, with useradd
and deletes both at the end (tests/_users.py); without root these tests skip.
Clients of that user run in ``tests/workers/as_user.py``, which drops root's
privileges before running them: the kernel then sees that user's uid in
SO_PEERCRED, in file permissions and in /proc.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, free_port, shm_entries, wait_for
from _users import User, group_dir, other_user
from tensordepot import BrokerUnavailable, Client, Forbidden, UntrustedBroker
from tensordepot.shm import PosixMapping

# 1 MiB: over the inline limit, so it goes through alloc + publish into a pooled segment
WEIGHTS = np.arange(1 << 18, dtype=np.float32)


@pytest.fixture(scope="module")
def other() -> Iterator[User]:
    yield from other_user()


@dataclass(frozen=True)
class Tokens:
    path: str
    admin: str
    read: str
    write: str
    team: str  # write, limited to names starting with "team-a/"


@pytest.fixture
def tokens(tmp_path: Path) -> Tokens:
    t = {k: secrets.token_urlsafe(24) for k in ("admin", "read", "write", "team")}
    path = tmp_path / "tokens"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f"# tokens of this broker\n{t['admin']} admin name=ops\n"
            f"{t['read']} read name=inference\n\n{t['write']}   write\n"
            f"{t['team']} write prefix=team-a/ name=team-a  \n"
        )
    return Tokens(str(path), **t)


def request(
    port: int, method: str, path: str, token: str | None = None, body: Any = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        with conn.getresponse() as r:
            data = r.read()
            return r.status, json.loads(data) if data else {}
    finally:
        conn.close()


def segments(b: BrokerProc) -> list[str]:
    return [n for n in b.segments() if not n.endswith("lock")]


# -- TCP: every route needs a token ------------------------------------------------------------

PROBE = """
import http.client, json
port, routes = int(ARGS[0]), json.loads(ARGS[1])
for method, path in routes:
    url = path.replace("{name}", "w").replace("{session}", "0" * 32)
    for auth in (None, "Bearer not-a-token-of-this-broker", "Basic b3BzOnNlY3JldA=="):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"content-type": "application/json"}
        if auth:
            headers["authorization"] = auth
        conn.request(method, url, body="{}", headers=headers)
        r = conn.getresponse()
        body = r.read()
        code = json.loads(body)["error"]["code"] if r.status >= 400 else None
        emit([method, path, r.status, code, r.getheader("www-authenticate")])
        conn.close()
"""


def test_another_user_without_a_token_gets_401_on_every_route_but_healthz(
    other: User, broker_factory: Callable[..., BrokerProc], tokens: Tokens
) -> None:
    port = free_port()
    broker_factory("--listen", f"http://127.0.0.1:{port}", "--token-file", tokens.path)
    status, doc = request(port, "GET", "/openapi.json", tokens.admin)
    assert status == 200
    routes = [
        (m.upper(), p.replace("{name:path}", "{name}"))
        for p, ops in doc["paths"].items()
        for m in ops
    ]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/nope")]
    assert len(routes) >= 20, routes
    seen = other.emits(PROBE, str(port), json.dumps(routes))
    assert len(seen) == 3 * len(routes)
    for method, path, status, code, challenge in seen:
        if path == "/healthz":
            assert status == 200, (method, path, status)
        else:
            assert (status, code, challenge) == (401, "unauthorized", "Bearer"), (
                method,
                path,
                status,
            )


# -- scopes: a reader cannot change what it reads --------------------------------------------

WORKER = """
import os
import numpy as np
from tensordepot import Client, DepotError
unix, tcp, token = ARGS[:3]
segments = ARGS[3].split(",")
tried = {}

def attempt(what, fn):
    try:
        fn()
        tried[what] = "ok"
    except DepotError as exc:
        tried[what] = [type(exc).__name__, str(exc)]

with Client(unix, token=token) as c:  # a unix peer whose uid is not admitted: the token decides
    w = c.get("model/w")
    tried["sum"] = float(np.from_dlpack(w).sum())
    tried["listed"] = sorted(i.name for i in c.list())
    zeros = np.zeros_like(np.from_dlpack(w))
    attempt("put", lambda: c.put("model/w", zeros))
    attempt("put_small", lambda: c.put("model/b", np.zeros(4, np.float32)))
    attempt("put_many", lambda: c.put_many({"model/w": zeros}))
    attempt("empty", lambda: c.empty("model/w", (4,), "float32"))
    attempt("delete", lambda: c.delete("model/w"))
    attempt("delete_other", lambda: c.delete("model/b"))
    del w
with Client(tcp, token=token) as c:
    attempt("put_tcp", lambda: c.put("model/w", np.zeros(4, np.float32)))
    attempt("delete_tcp", lambda: c.delete("model/w"))
for name in segments:  # and around the broker, straight at the memory
    for flags, what in ((os.O_RDONLY, "read"), (os.O_RDWR, "write")):
        try:
            os.close(os.open("/dev/shm/" + name, flags))
            tried[what + "-" + name] = "opened"
        except OSError as exc:
            tried[what + "-" + name] = exc.strerror
emit(tried)
"""


def test_an_inference_worker_with_a_read_token_cannot_change_its_weights(
    other: User, broker_factory: Callable[..., BrokerProc], tokens: Tokens
) -> None:
    port = free_port()
    tcp = f"http://127.0.0.1:{port}"
    b = broker_factory(
        "--listen",
        tcp,
        "--token-file",
        tokens.path,
        "--shm-group",
        other.group,
        sock_dir=group_dir(other.group_gid),
    )
    with b.client() as c:
        c.put("model/w", WEIGHTS)
        c.put("model/b", np.ones(4, np.float32))
    segs = segments(b)
    for name in segs:  # the group may map the weights, read-only
        st = os.stat(f"/dev/shm/{name}")
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, other.group_gid), name

    [tried] = other.emits(WORKER, b.url, tcp, tokens.read, ",".join(segs))
    assert tried["sum"] == float(WEIGHTS.sum())
    assert tried["listed"] == ["model/b", "model/w"]
    for what in (
        "put",
        "put_small",
        "put_many",
        "empty",
        "delete",
        "delete_other",
        "put_tcp",
        "delete_tcp",
    ):
        kind, message = tried[what]
        assert kind == "Forbidden", (what, tried[what])
        assert "needs the 'write' scope" in message
        assert "token:inference has scope 'read'" in message
        assert tokens.read not in message
    for name in segs:
        assert tried[f"read-{name}"] == "opened"
        assert tried[f"write-{name}"] == "Permission denied"

    with b.client() as c:
        w = c.get("model/w")
        assert w.version == 1 and np.array_equal(np.from_dlpack(w), WEIGHTS)
        assert [i.version for i in c.list()] == [1, 1]
        del w
    for path in ("/v1/put/model/w?dtype=float32&shape=1", "/v1/tensors/model/w"):
        method = "POST" if "put" in path else "DELETE"
        status, body = request(port, method, path, tokens.read)
        assert (status, body["error"]["code"]) == (403, "forbidden"), (path, body)


# -- prefixes: a team's token stays within its names ----------------------------------------


def test_a_prefix_limited_write_token_cannot_touch_other_names(
    broker_factory: Callable[..., BrokerProc], tokens: Tokens
) -> None:
    port = free_port()
    tcp = f"http://127.0.0.1:{port}"
    b = broker_factory("--listen", tcp, "--token-file", tokens.path)
    with b.client() as owner:
        owner.put("prod/w", WEIGHTS)
    with Client(tcp, token=tokens.team) as c:
        assert c.put("team-a/w", WEIGHTS) == 1  # alloc + publish
        assert c.put("team-a/small", np.ones(3)) == 1  # inline
        mine = c.get("team-a/w")
        with c.empty("team-a/e", (4,), "float32") as e:
            np.from_dlpack(e)[...] = 1
            e.publish()
        refused: dict[str, Callable[[], object]] = {
            "put": lambda: c.put("prod/w", np.zeros(3)),
            "put_large": lambda: c.put("prod/w", np.zeros_like(WEIGHTS)),
            "get": lambda: c.get("prod/w"),
            "delete": lambda: c.delete("prod/w"),
            "empty": lambda: c.empty("prod/x", (4,), "float32"),
            "link": lambda: c.put("prod/alias", mine),
            "put_many": lambda: c.put_many({"team-a/ok": np.ones(3), "prod/w": np.ones(3)}),
            "get_many": lambda: c.get_many(["team-a/w", "prod/w"]),
            "lookalike": lambda: c.put("team-a", np.ones(3)),
        }
        for fn in refused.values():
            with pytest.raises(Forbidden, match="may only use names starting with 'team-a/'"):
                fn()
        assert sorted(i.name for i in c.list()) == ["team-a/e", "team-a/small", "team-a/w"]
        mine.release()
    item = {"name": "prod/w", "version": 1}
    for method, path, body in (
        ("POST", "/v1/publish", item),
        ("POST", "/v1/abort", item),
        ("POST", "/v1/many/publish", {"names": ["prod/w"], "versions": [1]}),
        ("POST", "/v1/many/get", {"names": ["prod/w"]}),
        ("GET", "/v1/tensors/prod/w", None),
        ("GET", "/v1/tensors/", None),
    ):
        status, err = request(port, method, path, tokens.team, body)
        assert (status, err["error"]["code"]) == (403, "forbidden"), (path, err)
    with b.client() as owner:
        st = owner.stat()
        w = owner.get("prod/w")
        assert w.version == 1 and np.array_equal(np.from_dlpack(w), WEIGHTS)
        names = sorted(i.name for i in owner.list())
        del w
    assert names == ["prod/w", "team-a/e", "team-a/small", "team-a/w"], "put_many allocated nothing"
    assert st.versions == 4


# -- the unix socket: the kernel says who is calling ---------------------------------------

CONNECT = """
import errno, os, socket
out = {}
for path in ARGS[0].split(","):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.sendall(b"GET /v1/stat HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        out[path] = s.recv(65536).decode().split("\\r\\n")[0]
    except OSError as exc:
        out[path] = errno.errorcode[exc.errno]
    finally:
        s.close()
for name in filter(None, ARGS[1].split(",")):
    try:
        os.close(os.open("/dev/shm/" + name, os.O_RDONLY))
        out[name] = "opened"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
emit(out)
"""


def test_another_user_cannot_reach_the_socket_or_the_segments(
    other: User, broker_factory: Callable[..., BrokerProc], tmp_path_factory: pytest.TempPathFactory
) -> None:
    parent = os.path.join(str(tmp_path_factory.mktemp("auth", numbered=True)), "run")
    fresh = os.path.join(parent, "b.sock")  # a directory the broker creates
    b = broker_factory("--listen", f"unix://{fresh}")
    assert stat.S_IMODE(os.stat(parent).st_mode) == 0o700
    with b.client() as c:
        c.put("secret", WEIGHTS)
    segs = [*segments(b), b.prefix + "lock"]
    [out] = other.emits(CONNECT, f"{b.sock},{fresh}", ",".join(segs))
    assert out == {path: "EACCES" for path in (b.sock, fresh, *segs)}
    # With the directories opened up, the socket's own mode (0600) still refuses.
    for d in (str(tmp_path_factory.getbasetemp()), os.path.dirname(parent), parent):
        os.chmod(d, 0o711)
    [out] = other.emits(CONNECT, fresh, "")
    assert out == {fresh: "EACCES"}


def test_a_group_peer_needs_a_token_and_is_told_so(
    other: User, broker_factory: Callable[..., BrokerProc]
) -> None:
    """--shm-group lets the group reach the socket; SO_PEERCRED still refuses its uid."""
    d = group_dir(other.group_gid)
    fresh = os.path.join(d, "sub", "b.sock")
    b = broker_factory(
        "--listen", f"unix://{fresh}", "--shm-group", str(other.group_gid), sock_dir=d
    )
    for path, mode in ((os.path.dirname(fresh), 0o750), (fresh, 0o660), (b.sock, 0o660)):
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, other.group_gid), path
    [out] = other.emits(CONNECT, f"{b.sock},{fresh}", "")
    assert out == {b.sock: "HTTP/1.1 403 Forbidden", fresh: "HTTP/1.1 403 Forbidden"}
    res = other.run("from tensordepot import Client\nClient(ARGS[0])", b.url)
    assert res.returncode == 1
    assert (
        f"Forbidden: forbidden: uid {other.uid} ({other.name}) may not use this broker, which "
        f"runs as uid 0 (root); start the broker with --allow-uid {other.uid}"
    ) in res.stderr, res.stderr
    [out] = other.emits(CONNECT.replace("/v1/stat", "/healthz"), b.sock, "")
    assert out == {b.sock: "HTTP/1.1 200 OK"}, "/healthz answers anyone"
    # Outside the group, the socket's mode refuses before the broker is asked.
    res = other.run(CONNECT, b.sock, "", groups=False)
    assert json.loads(res.stdout) == {b.sock: "EACCES"}, res.stderr


EXCHANGE = """
import numpy as np
from tensordepot import Client
with Client(ARGS[0]) as c:
    c.put("from-peer", np.full(1 << 18, 7, np.float32))   # alloc + fill in place: maps writable
    got = np.from_dlpack(c.get("from-root"))
    emit([float(got.sum()), sorted(i.name for i in c.list())])
"""


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(lambda u: ["--allow-gid", u.group], id="allow-gid"),
        pytest.param(lambda u: ["--allow-uid", u.name, "--shm-group", u.group], id="allow-uid"),
    ],
)
def test_allowed_peers_exchange_tensors(
    other: User, broker_factory: Callable[..., BrokerProc], flags: Callable[[User], list[str]]
) -> None:
    b = broker_factory(*flags(other), sock_dir=group_dir(other.group_gid))
    with b.client() as c:
        c.put("from-root", WEIGHTS)
    [(total, names)] = other.emits(EXCHANGE, b.url)
    assert total == float(WEIGHTS.sum()) and names == ["from-peer", "from-root"]
    for name in segments(b):
        st = os.stat(f"/dev/shm/{name}")
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, other.group_gid), name
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("from-peer")), np.full(1 << 18, 7, np.float32))


# -- no squatting --------------------------------------------------------------------------


@pytest.fixture
def squat_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="td-squat-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_serve_refuses_a_squatted_socket_directory(other: User, squat_dir: str) -> None:
    from _harness import serve_once

    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    sock = os.path.join(squat_dir, "broker.sock")
    os.chmod(squat_dir, 0o777)  # root's, but anyone may swap the socket
    res = serve_once("--listen", f"unix://{sock}", "--shm-prefix", prefix)
    assert res.returncode == 1, res.stderr
    assert (
        f"the socket directory {squat_dir} is writable by group or others (owner uid 0 (root), "
        f"mode 0777)"
    ) in res.stderr, res.stderr
    assert "Run chmod go-w" in res.stderr and "Traceback" not in res.stderr
    os.chmod(squat_dir, 0o755)
    os.chown(squat_dir, other.uid, other.gid)  # someone else's
    res = serve_once("--listen", f"unix://{sock}", "--shm-prefix", prefix)
    assert res.returncode == 1, res.stderr
    assert (
        f"the socket directory {squat_dir} belongs to another user, not to this broker's uid "
        f"0 (root) (owner uid {other.uid} ({other.name}), mode 0755)"
    ) in res.stderr, res.stderr
    assert shm_entries(prefix) == [] and not os.path.exists(sock)


SERVE_DEFAULT = """
import sys
from tensordepot.cli import main
sys.exit(main(["serve", "--shm-prefix", ARGS[0], "--prealloc", "0"]))
"""


def test_the_default_socket_directory_of_another_user_cannot_be_squatted(other: User) -> None:
    """The victim's default socket, with XDG_RUNTIME_DIR unset: /tmp/tensordepot-<uid>."""
    path = f"/tmp/tensordepot-{other.uid}"
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    os.mkdir(path, 0o777)
    try:
        os.chmod(path, 0o777)  # pre-created by someone else (here root), open to all
        res = other.run(SERVE_DEFAULT, prefix)
        assert res.returncode == 1, res.stderr
        assert (
            f"the socket directory {path} belongs to another user, not to this broker's uid "
            f"{other.uid} ({other.name}) (owner uid 0 (root), mode 0777)"
        ) in res.stderr, res.stderr
    finally:
        shutil.rmtree(path)
    assert shm_entries(prefix) == []


FAKE_BROKER = """
import os, socket
path = ARGS[0]
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(8)
emit("ready")
while True:
    conn, _ = s.accept()
    conn.close()  # says nothing: only who listens matters here
"""


def test_a_client_refuses_a_socket_served_by_another_uid(
    other: User, squat_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.chown(squat_dir, other.uid, other.gid)
    os.chmod(squat_dir, 0o755)
    sock = os.path.join(squat_dir, "broker.sock")
    fake = other.spawn(FAKE_BROKER, sock)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == '"ready"'
        with pytest.raises(UntrustedBroker) as info:
            Client(f"unix://{sock}")
        msg = str(info.value)
        assert f"the broker socket {sock} is served by uid {other.uid} ({other.name})" in msg
        assert f"Client(trust_uid={other.uid})" in msg and "TENSORDEPOT_TRUST_UID" in msg
        # Trusting that user gets past the check, to a "broker" that says nothing.
        with pytest.raises(BrokerUnavailable) as unavailable:
            Client(f"unix://{sock}", trust_uid=other.name)
        assert not isinstance(unavailable.value, UntrustedBroker)
        monkeypatch.setenv("TENSORDEPOT_TRUST_UID", str(other.uid))
        with pytest.raises(BrokerUnavailable) as unavailable:
            Client(f"unix://{sock}")
        assert not isinstance(unavailable.value, UntrustedBroker)
    finally:
        fake.kill()
        fake.communicate()


def test_a_client_refuses_a_foreign_or_world_writable_segment(
    other: User, broker_factory: Callable[..., BrokerProc]
) -> None:
    b = broker_factory()
    with b.client() as c:
        c.put("w", WEIGHTS)
    [seg] = segments(b)
    path = f"/dev/shm/{seg}"
    for tamper, expect in (
        (lambda: os.chmod(path, 0o666), "its mode 0666 lets every user write it"),
        (
            lambda: os.chown(path, other.uid, -1),
            (f"it belongs to uid {other.uid} ({other.name}), a user this process does not trust"),
        ),
    ):
        tamper()
        try:
            with b.client() as c:
                with pytest.raises(
                    UntrustedBroker, match=re.escape(f"refusing to map segment {seg}: {expect}")
                ):
                    c.get("w")
                with pytest.raises(UntrustedBroker, match=re.escape(expect)):
                    c.put("w2", WEIGHTS)  # nothing of ours is written into it
                assert [i.name for i in c.list()] == ["w"], "the refused put left nothing behind"
        finally:
            os.chmod(path, 0o600)
            os.chown(path, 0, -1)
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("w")), WEIGHTS)
    link = f"{TEST_PREFIX}link-{secrets.token_hex(8)}"
    os.symlink(path, f"/dev/shm/{link}")
    try:
        with pytest.raises(UntrustedBroker, match="it is a symbolic link"):
            PosixMapping(link, writable=False)
    finally:
        os.unlink(f"/dev/shm/{link}")
    wait_for(lambda: b.stat().leases == 0, what="the refused gets' leases to come back")
