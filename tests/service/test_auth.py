"""The authorization layer on its own: the Principal each kind of peer gets,
the route table, and the token-file format.  End-to-end checks with real
users and sockets live in tests/e2e/test_auth.py."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from tensordepot.service import Settings, create_app
from tensordepot.service._auth import (
    ADMIN,
    READ,
    ROUTES,
    SCOPES,
    WRITE,
    AuthConfigError,
    AuthMiddleware,
    AuthPolicy,
    Principal,
    Token,
    check_routes,
    load_policy,
    match_route,
    read_token_file,
)
from tensordepot.service.routers import batch, cuda, many, sessions, system, tensors

ROOT = Path(__file__).resolve().parents[2]


def call(policy: AuthPolicy, method: str, path: str, state: dict[str, Any],
         headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, Principal | None]:
    """One request through AuthMiddleware; the status it answers (200 if it
    let the request through) and the principal the app behind it saw."""
    seen: dict[str, Any] = {}
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["principal"] = scope["state"]["principal"]

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path, "headers": headers or [],
             "state": state, "client": ("127.0.0.1", 5555)}
    asyncio.run(AuthMiddleware(app, policy)(scope, receive, send))
    status = sent[0]["status"] if sent else 200
    return status, seen.get("principal")


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
    policy = AuthPolicy(tokens=tokens_from(tmp_path, f"{read} read prefix=run/ name=inference"),
                        broker_uid=1000)
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
    assert status == 200 and p == Principal("token:inference", "unix", SCOPES[READ], uid=1001,
                                            pid=77, prefix="run/")
    assert call(policy, "GET", "/v1/stat", dict(other))[0] == 403
    assert call(policy, "GET", "/healthz", dict(other))[1] == Principal("anonymous", "tcp",
                                                                        frozenset())
    status, p = call(AuthPolicy(insecure_no_auth=True), "GET", "/v1/stat", {"connection": {}})
    assert status == 200 and p == Principal("anonymous", "tcp", SCOPES[ADMIN])


def test_scopes_prefixes_and_groups(tmp_path: Path) -> None:
    secret = {s: secrets.token_urlsafe(24) for s in (READ, WRITE)}
    text = f"{secret[READ]} read\n{secret[WRITE]} write prefix=a/"
    policy = AuthPolicy(tokens=tokens_from(tmp_path, text),
                        broker_uid=1000, allow_gids=frozenset({50}))
    tcp = {"unix": False}
    for method, path, token, status in (
            ("POST", "/v1/put/a/x", READ, 403), ("DELETE", "/v1/tensors/a/x", READ, 403),
            ("GET", "/v1/tensors/a/x", READ, 200), ("POST", "/v1/alloc", READ, 403),
            ("POST", "/v1/put/a/x", WRITE, 200), ("POST", "/v1/put/b/x", WRITE, 403),
            ("GET", "/v1/tensors/b", WRITE, 403), ("GET", "/v1/tensors/", WRITE, 403),
            ("HEAD", "/v1/tensors/b", WRITE, 403), ("GET", "/v1/tensors", WRITE, 200),
            ("GET", "/no/such/route", READ, 200)):  # the app answers 404 for it
        got, _ = call(policy, method, path, dict(tcp), bearer(secret[token]))
        assert got == status, (method, path, token)
    assert call(policy, "GET", "/v1/stat", dict(tcp), bearer("x" * 20))[0] == 401
    assert call(policy, "GET", "/v1/stat", dict(tcp))[0] == 401
    for gid, groups, admitted in ((50, (), True), (1001, (7, 50), True), (1001, (7,), False)):
        state = {"unix": True, "peercred": (1, 1001, gid), "peergroups": groups, "connection": {}}
        assert (call(policy, "GET", "/v1/stat", state)[0] == 200) is admitted, (gid, groups)


def test_every_route_of_the_app_has_a_scope() -> None:
    app = create_app(Settings(token="", insecure_no_auth=True))  # which checks them
    modules = (tensors, batch, many, sessions, system, cuda)
    routes = [*app.routes, *(r for m in modules for r in m.router.routes)]
    served = {(m, r.path) for r in routes for m in getattr(r, "methods", None) or () if m != "HEAD"}
    assert served == {(r.method, r.path) for r in ROUTES}, "ROUTES lists exactly the app's routes"
    for r in ROUTES:
        concrete = r.path.replace("{name:path}", "a/b").replace("{session}", "s1")
        assert match_route(r.method, concrete)[0] == r
    extra = FastAPI()

    @extra.post("/v1/shutdown")
    async def shutdown() -> None:
        return None

    with pytest.raises(RuntimeError, match=r"routes without a scope .*: POST /v1/shutdown"):
        check_routes(extra.routes)


def test_security_md_lists_every_scope() -> None:
    text = (ROOT / "SECURITY.md").read_text()
    table = text.split("<!-- scopes:begin -->")[1].split("<!-- scopes:end -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()[2:]]
    documented = [(m, p.strip("`"), None if s == "open" else s, n) for m, p, s, n in rows]
    assert documented == [(r.method, r.path, r.scope, r.note) for r in ROUTES]


def test_policy_refusals(tmp_path: Path) -> None:
    token = secrets.token_urlsafe(24)
    for kw, expect in (
            ({"token": token, "insecure_no_auth": True}, "drop one of the two"),
            ({"allow_gid": ["0", "1"]}, "carry one group"),
            ({"allow_gid": ["0"], "shm_group": "1"}, "differs from --shm-group"),
            ({"allow_uid": ["no-such-user-here"]}, "no user named 'no-such-user-here'"),
            ({"token": "short"}, "at least 16")):
        with pytest.raises(AuthConfigError, match=re.escape(expect)):
            load_policy(Settings(**kw))
    named = tokens_from(tmp_path, f"# c\n{token} write name=t1\n")
    assert [(t.id, t.scope) for t in named] == [("token:t1", WRITE)]
    unnamed = tokens_from(tmp_path, f"{token} read")
    assert unnamed[0].id.startswith("token:") and token not in repr(unnamed[0])
    assert unnamed[0].id == tokens_from(tmp_path, f"{token} admin")[0].id, "stable for a token"
