"""The authorization layer on its own: the Principal each kind of peer gets,
the route table, and the token-file format.  End-to-end checks with real
users and sockets live in tests/e2e/test_auth.py."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tensordepot import DepotError
from tensordepot.service import Settings, create_app
from tensordepot.service._auth import (
    ADMIN,
    READ,
    SCOPES,
    WRITE,
    AuthConfigError,
    AuthPolicy,
    Principal,
    Token,
    load_policy,
    read_token_file,
)
from tensordepot.service._http._gate import Gate, NoRoute
from tensordepot.service._http._routes import ROUTES, match
from tensordepot.service._metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]


def call(
    policy: AuthPolicy,
    method: str,
    path: str,
    state: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, Principal | None]:
    """One request's head through the gate's admission; the status it answers
    (200 if it let the request through) and the principal it resolved."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers or [],
        "state": state,
        "client": ("127.0.0.1", 5555),
    }
    gate = Gate(SimpleNamespace(), policy, Metrics(lambda: None))
    try:
        return 200, gate.admit(method, path, scope).principal
    except NoRoute as exc:  # admitted, but no route serves it (404, 405)
        return exc.status, scope["state"]["principal"]
    except DepotError as exc:
        return exc.status, None


def tokens_from(tmp: Path, text: str) -> tuple[Token, ...]:
    path = tmp / f"tokens-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return tuple(read_token_file(str(path)))


def bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


def test_the_principal_contract(tmp_path: Path) -> None:
    """What the rest of the broker may rely on: ``scope["state"]["principal"]``."""
    read = secrets.token_urlsafe(24)
    policy = AuthPolicy(
        tokens=tokens_from(tmp_path, f"{read} read prefix=run/ name=inference"), broker_uid=1000
    )
    conn: dict[str, Any] = {}
    unix = {"unix": True, "peercred": (4242, 1000, 1000), "peergroups": (), "connection": conn}
    status, p = call(policy, "POST", "/v1/put/x", dict(unix))
    assert status == 200 and p == Principal("uid:1000", "unix", SCOPES[ADMIN], uid=1000, pid=4242)
    _, again = call(policy, "GET", "/v1/stat", {**unix, "connection": {}})
    assert again is not None and again.id == "uid:1000", "stable across connections"

    status, p = call(policy, "GET", "/v1/tensors/run/w", {"unix": False}, bearer(read))
    assert status == 200 and p == Principal("token:inference", "tcp", SCOPES[READ], prefix="run/")
    assert p.pid is None and p.uid is None, "nothing a TCP client claims"
    # The same token over a unix socket by a uid that is not admitted: the
    # token's scope, with the kernel's uid and pid.
    other = {"unix": True, "peercred": (77, 1001, 1001), "peergroups": (), "connection": {}}
    status, p = call(policy, "GET", "/v1/stat", other, bearer(read))
    assert status == 200 and p == Principal(
        "token:inference", "unix", SCOPES[READ], uid=1001, pid=77, prefix="run/"
    )
    assert call(policy, "GET", "/v1/stat", dict(other))[0] == 403
    assert call(policy, "GET", "/healthz", dict(other))[1] == Principal(
        "anonymous", "tcp", frozenset()
    )
    status, p = call(AuthPolicy(insecure_no_auth=True), "GET", "/v1/stat", {"connection": {}})
    assert status == 200 and p == Principal("anonymous", "tcp", SCOPES[ADMIN])


def test_scopes_prefixes_and_groups(tmp_path: Path) -> None:
    secret = {s: secrets.token_urlsafe(24) for s in (READ, WRITE)}
    text = f"{secret[READ]} read\n{secret[WRITE]} write prefix=a/"
    policy = AuthPolicy(
        tokens=tokens_from(tmp_path, text), broker_uid=1000, allow_gids=frozenset({50})
    )
    tcp = {"unix": False}
    for method, path, token, status in (
        ("POST", "/v1/put/a/x", READ, 403),
        ("DELETE", "/v1/tensors/a/x", READ, 403),
        ("GET", "/v1/tensors/a/x", READ, 200),
        ("POST", "/v1/alloc", READ, 403),
        ("POST", "/v1/put/a/x", WRITE, 200),
        ("POST", "/v1/put/b/x", WRITE, 403),
        ("GET", "/v1/tensors/b", WRITE, 403),
        ("GET", "/v1/tensors/", WRITE, 403),
        ("HEAD", "/v1/tensors/a/x", WRITE, 405),  # a HEAD may not take a lease
        ("HEAD", "/v1/stat", READ, 200),
        ("GET", "/v1/tensors", WRITE, 200),
        ("GET", "/no/such/route", READ, 404),
        ("GET", "/no/such/route", None, 401),
    ):
        got, _ = call(policy, method, path, dict(tcp), bearer(secret[token]) if token else [])
        assert got == status, (method, path, token)
    assert call(policy, "GET", "/v1/stat", dict(tcp), bearer("x" * 20))[0] == 401
    assert call(policy, "GET", "/v1/stat", dict(tcp))[0] == 401
    for gid, groups, admitted in ((50, (), True), (1001, (7, 50), True), (1001, (7,), False)):
        state = {"unix": True, "peercred": (1, 1001, gid), "peergroups": groups, "connection": {}}
        assert (call(policy, "GET", "/v1/stat", state)[0] == 200) is admitted, (gid, groups)


def test_every_route_goes_through_the_gate() -> None:
    """The route table is the only routing: FastAPI's own router holds just
    the API documents, which the gate admits too, and every route of the
    table has a scope and is matched by its own template."""
    app = create_app(Settings(token="", insecure_no_auth=True))
    documents = {(r.method, r.path) for r in ROUTES if r.handler is None}
    fastapi_routes = {
        (m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or () if m != "HEAD"
    }
    assert fastapi_routes == documents, "FastAPI serves nothing but the documents"
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    for r in ROUTES:
        assert r.scope in (None, READ, WRITE, ADMIN), r
        concrete = r.path.replace("{name:path}", "a/b").replace("{session}", "s1")
        assert match(r.method, concrete)[0] == r
    assert match("POST", "/v1/shutdown")[0] is None
    assert match("PUT", "/v1/stat") == (None, {}, True), "another method: 405"


def test_the_readme_route_table_is_the_route_table() -> None:
    """The README shows the route table once (SECURITY.md points to it)."""
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- routes:begin -->")[1].split("<!-- routes:end -->")[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in table.strip().splitlines()[2:]
    ]
    documented = [(m, p.strip("`"), None if s == "open" else s, n) for m, p, _, s, n in rows]
    assert documented == [(r.method, r.path, r.scope, r.note) for r in ROUTES]
    assert [op for _, _, op, _, _ in rows] == [r.op if r.handler else "(FastAPI)" for r in ROUTES]
    assert "README.md#how-it-fits-together" in (ROOT / "SECURITY.md").read_text()


def test_policy_refusals(tmp_path: Path) -> None:
    token = secrets.token_urlsafe(24)
    for kw, expect in (
        ({"token": token, "insecure_no_auth": True}, "drop one of the two"),
        ({"allow_gid": ["0", "1"]}, "carry one group"),
        ({"allow_gid": ["0"], "shm_group": "1"}, "differs from --shm-group"),
        ({"allow_uid": ["no-such-user-here"]}, "no user named 'no-such-user-here'"),
        ({"token": "short"}, "at least 16"),
    ):
        with pytest.raises(AuthConfigError, match=re.escape(expect)):
            load_policy(Settings(**kw))
    named = tokens_from(tmp_path, f"# c\n{token} write name=t1\n")
    assert [(t.id, t.scope) for t in named] == [("token:t1", WRITE)]
    unnamed = tokens_from(tmp_path, f"{token} read")
    assert unnamed[0].id.startswith("token:") and token not in repr(unnamed[0])
    assert unnamed[0].id == tokens_from(tmp_path, f"{token} admin")[0].id, "stable for a token"
