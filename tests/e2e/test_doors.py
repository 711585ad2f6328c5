"""Every door gives the same answer and has the same effect, route by route.

The broker has two doors for HTTP: the fast lane inside the HTTP protocol
(service/_http/_lane.py) and ASGI (FastAPI).  Each case of ``CASES`` is sent through
every door of ``DOORS`` to one real ``tensordepot serve`` process, over TCP
with tokens of several scopes (or its unix socket).  At each door the answer
must be what the case expects, and the same as at the other doors: its
status, its error code (``{"error": {"code", "message"}}``), and its effect
on the broker's accounting (the deltas of ``GET /v1/stat``, and the names
``GET /v1/tensors`` gains or loses).  Every answer carries the
``x-tensordepot-broker`` header, every error the one error body, and every
401 ``www-authenticate: Bearer``.

Doors:

* ``lane``: a plain request.  The lane takes every route it serves.
* ``asgi``: the same request with ``x-tensordepot-door: asgi``.  The lane
  declines it, and ASGI serves it.
* ``expect``: the same request with ``Expect: 100-continue``, sent with its
  body at once, as curl does for bodies over 1 KiB.  Today's lane declines
  such a request (ASGI answers it, after an interim ``100 Continue``), so
  this door reaches ASGI even on a broker that ignores the door header.
* ``shm``: the shared-memory lane (docs/plan-lane.md), for the routes it
  serves: the case is prepared and sent as the unix socket's owner (the
  only one a lane is passed to, where the other doors send as the admin
  token), its request a record on a lane of its session.  Its answer has
  no HTTP headers; its media kind stands for the content type.  A case
  the lane cannot carry as it is (a chunked body, another token, another
  principal's session, a header that frames HTTP) is not run there.

Each case runs under fresh names (``Env.ns``) and fresh sessions, which are
closed after it.  ``test_every_route_has_a_case`` fails when an operation
of ``GET /openapi.json`` has no case, so that no new route goes untested.
A failing case shows what each door did; ``pytest -rP`` shows it for every case.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import secrets
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from _harness import BrokerProc, free_port, wait_for
from _rawhttp import Address, Answer, encode, exchange
from _rawlane import RawLane, handover
from tensordepot._laneproto import MEDIA_JSON, request_record
from tensordepot._proto import (
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    RELEASE_HEADER,
    REQUEST_HEADER,
    SERVER_HEADER,
    SESSION_HEADER,
)
from tensordepot.client._shmlane import on_lane

SHM = "shm"  # the shared-memory lane: the routes it serves, as the unix socket's owner
DOOR_HEADER = "x-tensordepot-door"
DOORS: dict[str, tuple[tuple[str, str], ...]] = {
    "lane": (),
    "asgi": ((DOOR_HEADER, "asgi"),),
    "expect": (("Expect", "100-continue"),),
}
SESSION_TTL = 2.0  # seconds: the stale-release case waits for a session to lapse
TEAM = "team-a/"  # the prefix of the "team" token
UNIX = "unix"  # who: the broker's own uid on its unix socket (admin, by SO_PEERCRED)
# What /v1/stat deltas are compared; the rest (reserved bytes, segments) follows the pool.
ACCOUNTS = ("bytes_in_use", "bytes_retired", "tensors", "versions", "leases", "sessions", "waiting")
JSON = "application/json"
ANY = "*"  # an error code: any, as long as every door gives the same one
NBYTES = 16  # every tensor here: 16 uint8
OCTETS = "application/octet-stream"


# -- the broker ------------------------------------------------------------------------------


@dataclass
class Depot:
    """One broker, its TCP port and its tokens (by scope name)."""

    broker: BrokerProc
    port: int
    tokens: dict[str, str]
    _lapsed: dict[str, tuple[str, int]] = field(default_factory=dict)
    _retired: int = 0

    def address(self, who: str | None) -> Address:
        return self.broker.sock if who == UNIX else ("127.0.0.1", self.port)

    def send(
        self,
        method: str,
        target: str | bytes,
        body: bytes | None = None,
        *,
        who: str | None = "admin",
        sid: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
        ctype: str | None = JSON,
        chunk: bool = False,
    ) -> Answer:
        hs: list[tuple[str, str]] = []
        if who is not None and who != UNIX:
            hs.append(("Authorization", f"Bearer {self.tokens[who]}"))
        if sid is not None:
            hs.append((SESSION_HEADER, sid))
        if body is not None and ctype is not None:
            hs.append(("Content-Type", ctype))
        hs += headers
        return exchange(self.address(who), encode(method, target, hs, body, chunk=chunk))

    def stat(self) -> dict[str, int]:
        a = self.send("GET", "/v1/stat", who=UNIX)
        assert a.status == 200, a
        return {k: v for k, v in a.json().items() if k in ACCOUNTS}

    def names(self) -> set[str]:
        a = self.send("GET", "/v1/tensors", who=UNIX)
        assert a.status == 200, a
        return {i["name"] for i in a.json()["items"]}

    def lapsed(self, door: str) -> tuple[str, int, int]:
        """A write-token session of ``door`` that lapsed holding a lease on a
        deleted tensor, so that its block is retired: (session, lease, bytes
        retired).  Made for every door at once, so they lapse together."""
        if not self._lapsed:
            base = self.stat()
            for d in DOORS:
                env = Env(self, d)
                name = env.put("stale")
                sid = env.call(
                    "POST", "/v1/sessions", {"pid": 1}, who="write", session=False
                ).json()["session"]
                lease = env.call("GET", f"/v1/tensors/{quote(name)}", who="write", sid=sid).json()[
                    "lease"
                ]
                env.call("DELETE", f"/v1/tensors/{quote(name)}", expect=204)  # the lease keeps it
                self._lapsed[d] = sid, lease

            def gone() -> dict[str, int] | None:
                st = self.stat()
                return (
                    st
                    if (
                        st["sessions"] <= base["sessions"]
                        and st["bytes_retired"] > base["bytes_retired"]
                    )
                    else None
                )

            st = wait_for(gone, 10 + 3 * SESSION_TTL, what="the heartbeat sessions to lapse")
            self._retired = (st["bytes_retired"] - base["bytes_retired"]) // len(DOORS)
        sid, lease = self._lapsed[door]
        return sid, lease, self._retired


def _tokens(path: Path) -> dict[str, str]:
    t = {k: secrets.token_urlsafe(24) for k in ("admin", "read", "write", "team")}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f"{t['admin']} admin name=ops\n{t['read']} read name=reader\n"
            f"{t['write']} write name=writer\n{t['team']} write prefix={TEAM} name=team\n"
        )
    return t


def _undeletable(depot: Depot) -> list[str]:
    # A name with a newline cannot be named by a path (a Starlette route cuts
    # it at the newline): a door that wrongly created one gave it a ttl.
    return [n for n in depot.names() if "\n" in n]


@pytest.fixture(scope="module")
def depot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Depot]:
    path = tmp_path_factory.mktemp("doors") / "tokens"
    tokens = _tokens(path)
    port = free_port()
    b = BrokerProc(
        "--listen",
        f"http://127.0.0.1:{port}",
        "--token-file",
        str(path),
        "--session-ttl",
        str(SESSION_TTL),
    )
    try:
        d = Depot(b, port, tokens)
        # An anchor in the pool segment: a segment left with only retired ranges
        # is given back to the kernel, which would undo a retirement by itself.
        anchor = Env(d, "fixture")
        anchor.put("anchor")
        anchor.close_sessions()
        yield d
        assert b.alive, f"the broker died:\n{b.log()}"
        wait_for(lambda: not _undeletable(d), 10, what="names with a newline to expire")
        b.check_clean()
        assert b.stop() == 0, b.log()
        assert b.segments() == [], b.segments()
    finally:
        b.cleanup()


# -- one case at one door --------------------------------------------------------------------

_serial = itertools.count()


@dataclass(frozen=True)
class Req:
    """The request a case measures."""

    method: str
    target: str | bytes
    body: bytes | None = None
    who: str | None = "admin"  # a token's name (TCP), UNIX, or None: TCP without a token
    sid: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    ctype: str | None = JSON
    chunk: bool = False
    repeat: int = 1  # sent this many times: every answer must be the first one


def _body(obj: Any) -> bytes | None:
    if obj is None or isinstance(obj, bytes):
        return obj
    return json.dumps(obj).encode()


class Env:
    """A case's names and sessions at one door."""

    def __init__(self, depot: Depot, door: str) -> None:
        self.depot, self.door = depot, door
        self.ns = f"d{next(_serial)}.{door}."
        self.sessions: dict[str, str] = {}  # who -> its session
        self.extra: list[tuple[str, str]] = []  # (who, session) more to close
        self.values: dict[str, Any] = {}  # what prepare learnt, for the case's check

    def name(self, x: str = "w", team: bool = False) -> str:
        return (TEAM if team else "") + self.ns + x

    def who(self, who: str) -> str:
        """At the shm door the admin is the unix socket's owner (only it gets
        a lane); elsewhere ``who`` itself."""
        return UNIX if self.door == SHM and who == "admin" else who

    def session(self, who: str = "admin") -> str:
        who = self.who(who)
        if who not in self.sessions:
            a = self.call("POST", "/v1/sessions", {"pid": 1}, who=who, session=False)
            self.sessions[who] = a.json()["session"]
        return self.sessions[who]

    def adopt(self, who: str, sid: str) -> None:
        self.extra.append((who, sid))

    def call(
        self,
        method: str,
        target: str,
        obj: Any = None,
        *,
        who: str = "admin",
        session: bool = True,
        sid: str | None = None,
        expect: int = 200,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Answer:
        """A request that prepares a case, through no particular door: it must succeed."""
        who = self.who(who)
        if sid is None and session:
            sid = self.session(who)
        a = self.depot.send(method, target, _body(obj), who=who, sid=sid, headers=headers)
        assert a.status == expect, (method, target, a)
        return a

    def req(
        self,
        method: str,
        target: str | bytes,
        obj: Any = None,
        *,
        who: str | None = "admin",
        session: bool = True,
        **kw: Any,
    ) -> Req:
        who = None if who is None else self.who(who)
        sid = self.session(who) if session and who is not None and "sid" not in kw else None
        return Req(method, target, _body(obj), who=who, **{"sid": sid, **kw})

    def put(self, x: str = "w", who: str = "admin", team: bool = False) -> str:
        name = self.name(x, team)
        self.call(
            "POST", f"/v1/put/{quote(name)}?dtype=uint8&shape={NBYTES}", b"\0" * NBYTES, who=who
        )
        return name

    def lease(self, name: str, who: str = "admin") -> int:
        lease: int = self.call("GET", f"/v1/tensors/{quote(name)}", who=who).json()["lease"]
        return lease

    def alloc(self, x: str = "w", who: str = "admin") -> tuple[str, int]:
        name = self.name(x)
        a = self.call(
            "POST", "/v1/alloc", {"name": name, "shape": [NBYTES], "dtype": "uint8"}, who=who
        )
        return name, a.json()["version"]

    def close_sessions(self) -> None:
        for who, sid in [*self.sessions.items(), *self.extra]:
            self.depot.send("DELETE", f"/v1/sessions/{sid}", who=who)  # maybe gone already
        self.sessions.clear()
        self.extra.clear()

    def close(self) -> None:
        self.close_sessions()
        for name in self.depot.names():
            if self.ns in name and "\n" not in name:
                self.depot.send("DELETE", f"/v1/tensors/{quote(name)}", who=UNIX)


@dataclass(frozen=True)
class Seen:
    """What one door did with a case's request."""

    status: int
    code: str | None
    delta: tuple[tuple[str, int], ...]  # accounts that changed
    created: frozenset[str]  # names, without the case's namespace
    deleted: frozenset[str]
    keys: tuple[str, ...] | None  # a JSON object's keys, on success
    problems: tuple[str, ...]  # what no answer may do (no mark, no error body, ...)

    def __str__(self) -> str:
        out = f"{self.status} {self.code or '-'}"
        if self.delta:
            out += " " + ", ".join(f"{k} {v:+d}" for k, v in self.delta)
        if self.created:
            out += f" created {sorted(self.created)}"
        if self.deleted:
            out += f" deleted {sorted(self.deleted)}"
        if self.problems:
            out += f" PROBLEMS {list(self.problems)}"
        return out


def _door_problems(door: str, a: Answer) -> list[str]:
    """Whether the door asked for is the one that answered: uvicorn's ASGI
    cycle adds a ``date`` header, the lane's one write does not.  Answers the
    HTTP protocol gives itself (431, an unparsable request) carry neither."""
    from_protocol = a.status == 431 or (
        a.status == 400 and a.header("date") is None and b"Invalid HTTP request" in a.body
    )
    if door in ("lane", SHM) or from_protocol:
        return []
    if a.header("date") is None:
        return [f"the {door} door was answered by the lane (no date header)"]
    return []


def _problems(a: Answer, door: str) -> list[str]:
    out = []
    if door == SHM:  # no HTTP headers: its media kind stands for the content type
        pass
    elif not a.header(SERVER_HEADER):
        out.append(f"no {SERVER_HEADER} header")
    if a.status == 401 and a.header("www-authenticate") != "Bearer":
        out.append(f"401 with www-authenticate {a.header('www-authenticate')!r}")
    if a.status >= 400:
        try:
            body = a.json()
            err = body["error"]
            ok = (
                set(body) == {"error"}
                and set(err) == {"code", "message"}
                and isinstance(err["code"], str)
                and err["code"]
                and isinstance(err["message"], str)
                and err["message"]
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            out.append(f"not the error body: {a.body[:80]!r}")
        if not (a.header("content-type") or "").startswith(JSON):
            out.append(f"content-type {a.header('content-type')!r}")
    return out


def _relative(names: set[str], ns: str) -> frozenset[str]:
    return frozenset(n.replace(ns, "", 1) for n in names)


def _keys(a: Answer) -> tuple[str, ...] | None:
    if a.status >= 400 or not a.body:
        return None
    try:
        body = a.json()
    except ValueError:
        return None
    return tuple(sorted(body)) if isinstance(body, dict) else None


@dataclass(frozen=True)
class Case:
    route: tuple[str, str]  # the OpenAPI operation it covers
    prepare: Callable[[Env], Req]
    status: int | tuple[int, ...]
    code: str | None = None  # None: no error; ANY: some error code
    delta: Mapping[str, int] | Callable[[Env], Mapping[str, int]] = field(default_factory=dict)
    created: frozenset[str] = frozenset()
    deleted: frozenset[str] = frozenset()
    check: Callable[[Env, Answer], None] | None = None  # more about the answer

    def wanted(self, env: Env) -> str:
        delta = self.delta(env) if callable(self.delta) else self.delta
        shown = Seen(
            0,
            self.code,
            tuple((k, v) for k, v in delta.items() if v),
            self.created,
            self.deleted,
            None,
            (),
        )
        return f"{self.status} {str(shown).partition(' ')[2]}"

    def matches(self, env: Env, seen: Seen) -> bool:
        statuses = (self.status,) if isinstance(self.status, int) else self.status
        delta = self.delta(env) if callable(self.delta) else self.delta
        want = tuple(sorted((k, v) for k, v in delta.items() if v))
        if self.code == ANY:
            code_ok = seen.code is not None or seen.status < 400
        else:
            code_ok = seen.code == self.code
        return (
            seen.status in statuses
            and code_ok
            and tuple(sorted(seen.delta)) == want
            and seen.created == self.created
            and seen.deleted == self.deleted
            and not seen.problems
        )


def run(depot: Depot, case: Case, door: str) -> tuple[Seen, Env] | None:
    """What ``door`` did with ``case``; None: the shm door does not take it."""
    if door == SHM and not on_lane(*case.route):
        return None
    env = Env(depot, door)
    lane: RawLane | None = None
    try:
        req = case.prepare(env)
        if door == SHM:
            lane = _lane_for(env, req)
            if lane is None:
                return None
        before, names = depot.stat(), depot.names()
        answers = [
            depot.send(
                req.method,
                req.target,
                req.body,
                who=req.who,
                sid=req.sid,
                headers=req.headers + DOORS[door],
                ctype=req.ctype,
                chunk=req.chunk,
            )
            if lane is None
            else _on_lane(lane, req)
            for _ in range(req.repeat)
        ]
        after, names_after = depot.stat(), depot.names()
        a = answers[0]
        problems = [p for x in answers for p in _problems(x, door) + _door_problems(door, x)]
        if any((x.status, x.body) != (a.status, a.body) for x in answers[1:]):
            problems.append(f"a resend got another answer: {[str(x) for x in answers]}")
        if case.check is not None:
            try:
                case.check(env, a)
            except (AssertionError, ValueError, KeyError, TypeError) as exc:
                problems.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        seen = Seen(
            a.status,
            a.code,
            tuple((k, after[k] - before[k]) for k in ACCOUNTS if after[k] != before[k]),
            _relative(names_after - names, env.ns),
            _relative(names - names_after, env.ns),
            _keys(a),
            tuple(problems),
        )
    finally:
        if lane is not None:
            lane.close()
        env.close()
    return seen, env


def _lane_for(env: Env, req: Req) -> RawLane | None:
    """A lane for ``req``'s session (or a new one of the socket's owner), if
    the lane can carry ``req`` (a route it serves, sent by the unix socket's
    owner as a plain request); None if not."""
    if (
        not isinstance(req.target, str)
        or req.chunk
        or req.who != UNIX
        or not on_lane(req.method, req.target.partition("?")[0])
        or any(k.lower() in ("expect", "content-length") for k, _ in req.headers)
    ):
        return None
    try:  # a record larger than a ring (a case of HTTP's own limits) is not sent there
        size = len(request_record(0, req.method, req.target, _lane_headers(req), req.body or b""))
    except struct.error:
        return None
    status, _, fds = handover(env.depot.broker.sock, req.sid or env.session(UNIX))
    if status != 200:
        return None
    lane = RawLane(fds)
    if size > lane.mem.requests.most():  # type: ignore[union-attr]
        lane.close()
        return None
    return lane


def _lane_headers(req: Req) -> list[tuple[bytes, bytes]]:
    headers = [(k.lower().encode(), v.encode()) for k, v in req.headers]
    if req.body is not None and req.ctype is not None:
        headers.append((b"content-type", req.ctype.encode()))
    return headers


def _on_lane(lane: RawLane, req: Req) -> Answer:
    """``req`` as a record on ``lane`` (its session the lane's own), its
    answer as an ``Answer`` without headers but the content type its media
    kind stands for."""
    assert isinstance(req.target, str)
    seq = lane.send(req.method, req.target, req.body or b"", _lane_headers(req))
    got = lane.answer_with_media(30)
    assert got is not None and got[0] == seq, f"no answer on the lane to {req.target!r}"
    _, status, media, body = got
    return Answer(status, (("content-type", JSON if media == MEDIA_JSON else OCTETS),), body)


# -- the table ---------------------------------------------------------------------------------


def released(n: int) -> Callable[[Env, Answer], None]:
    def check(env: Env, a: Answer) -> None:
        if a.json() != {"released": n}:
            raise AssertionError(f"answered {a.body.decode()}, not released {n}")

    return check


def _session_made(env: Env, a: Answer) -> None:
    env.adopt("admin", a.json()["session"])


def _fork_made(env: Env, a: Answer) -> None:
    info = a.json()
    env.adopt("admin", info["session"])
    assert list(info["leases"]) == [str(env.values["lease"])], info


def _fork(env: Env) -> Req:
    env.values["lease"] = env.lease(env.put())
    return env.req("POST", f"/v1/sessions/{env.session()}/fork")


def _claim(env: Env) -> Req:
    child = env.call("POST", f"/v1/sessions/{env.session()}/fork").json()["session"]
    env.adopt("admin", child)
    return env.req("POST", f"/v1/sessions/{child}/claim", session=False)


def _close_session(env: Env) -> Req:
    sid = env.call("POST", "/v1/sessions", {"pid": 1}, session=False).json()["session"]
    env.adopt("admin", sid)
    env.call("GET", f"/v1/tensors/{quote(env.put())}", sid=sid)
    return env.req("DELETE", f"/v1/sessions/{sid}", session=False)


def _team_listing(env: Env, a: Answer) -> None:
    names = [i["name"] for i in a.json()["items"]]
    assert env.name("mine", team=True) in names and all(n.startswith(TEAM) for n in names), names


def _listing(env: Env) -> Req:
    env.put("mine", team=True)
    env.put("theirs")
    return env.req("GET", "/v1/tensors", who="team")


def _written(env: Env, x: str = "w") -> dict[str, Any]:
    """A version allocated and not yet published, as publish and abort name it."""
    name, version = env.alloc(x)
    return {"name": name, "version": version}


def _publish(env: Env) -> Req:
    return env.req("POST", "/v1/publish", _written(env))


def _abort(env: Env) -> Req:
    return env.req("POST", "/v1/abort", _written(env))


def _link(env: Env) -> Req:
    lease = env.lease(env.put("src"))
    return env.req("POST", "/v1/link", {"name": env.name("dst"), "lease": lease})


def _release(env: Env) -> Req:
    return env.req("POST", "/v1/release", {"leases": [env.lease(env.put())]})


def _many_alloc_body(env: Env, devices: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "names": [env.name("a"), env.name("b")],
        "shapes": [[NBYTES], [NBYTES]],
        "dtypes": ["uint8", "uint8"],
    }
    if devices is not None:
        body["devices"] = devices
    return body


def _many_publish(env: Env) -> Req:
    pairs = [env.alloc(x) for x in "ab"]
    return env.req(
        "POST",
        "/v1/many/publish",
        {"names": [n for n, _ in pairs], "versions": [v for _, v in pairs]},
    )


def _framed(head: Any, data: bytes) -> bytes:
    """A ``/v1/many/put`` body: the JSON head's length in 4 bytes, the head, the bytes."""
    text = json.dumps(head).encode()
    return len(text).to_bytes(4, "big") + text + data


def _many_put(
    env: Env,
    data: bytes = b"\1" * 2 * NBYTES,
    who: str = "admin",
    names: tuple[str, ...] = ("a", "b"),
    ctype: str | None = OCTETS,
    team: bool = False,
) -> Req:
    head = {
        "names": [env.name(x, team) for x in names],
        "shapes": [[NBYTES]] * len(names),
        "dtypes": ["uint8"] * len(names),
    }
    return env.req("POST", "/v1/many/put", _framed(head, data), who=who, ctype=ctype)


def _known_get(env: Env) -> Req:
    """A get_many of a put_many's pack naming the key of the columns an
    earlier get_many of it gave (``?known=``): answered without them."""
    names = [env.name("a"), env.name("b")]
    head = {"names": names, "shapes": [[NBYTES]] * 2, "dtypes": ["uint8"] * 2}
    who = env.who("admin")
    body = _framed(head, b"\1" * 2 * NBYTES)
    put = env.depot.send("POST", "/v1/many/put", body, who=who, sid=env.session(who), ctype=OCTETS)
    assert put.status == 200, put
    key = env.call("POST", "/v1/many/get", {"names": names}).json()["key"]
    return env.req("POST", f"/v1/many/get?known={key}", {"names": names})


def _floored(query: str, floors: list[int] | None = None) -> Callable[[Env], Req]:
    """A get_many of one tensor with ``query`` (its ``newer_than`` for every
    name) and, given ``floors``, the body's per name as well."""
    extra = {} if floors is None else {"newer_than": floors}
    return lambda e: e.req("POST", f"/v1/many/get{query}", {"names": [e.put("a")], **extra})


def _short(env: Env, answer: Answer) -> None:
    got = answer.json()
    assert got["names"] == [] and got["key"] and len(got["versions"]) == 2, got


NO_GPU = "cuda:GPU-00000000-0000-0000-0000-000000000000"  # a GPU no broker has


def _share_body(env: Env) -> dict[str, Any]:
    return {
        "name": env.name(),
        "shape": [4],
        "dtype": "float32",
        "device": NO_GPU,
        "ipc_handle": base64.b64encode(b"\1" * 64).decode(),
        "offset": 0,
        "alloc_size": 16,
    }


def _metrics_text(env: Env, a: Answer) -> None:
    assert (a.header("content-type") or "").startswith("text/plain"), a.headers
    assert b"# TYPE" in a.body, a.body[:200]


def _health(env: Env, a: Answer) -> None:
    assert a.json()["status"] == "ok", a.body


NEW = {"bytes_in_use": NBYTES, "versions": 1}  # an allocation
PUT = {**NEW, "tensors": 1}
TWO = {"bytes_in_use": 2 * NBYTES, "versions": 2}

R_SESSIONS = ("POST", "/v1/sessions")
R_HEARTBEAT = ("POST", "/v1/sessions/{session}/heartbeat")
R_FORK = ("POST", "/v1/sessions/{session}/fork")
R_CLAIM = ("POST", "/v1/sessions/{session}/claim")
R_LANE = ("POST", "/v1/lane")
R_CLOSE = ("DELETE", "/v1/sessions/{session}")
R_LIST = ("GET", "/v1/tensors")
R_GET = ("GET", "/v1/tensors/{name}")
R_DELETE = ("DELETE", "/v1/tensors/{name}")
R_PUT = ("POST", "/v1/put/{name}")
R_ALLOC = ("POST", "/v1/alloc")
R_PUBLISH = ("POST", "/v1/publish")
R_ABORT = ("POST", "/v1/abort")
R_LINK = ("POST", "/v1/link")
R_RELEASE = ("POST", "/v1/release")
R_MANY_ALLOC = ("POST", "/v1/many/alloc")
R_MANY_PUBLISH = ("POST", "/v1/many/publish")
R_MANY_PUT = ("POST", "/v1/many/put")
R_MANY_GET = ("POST", "/v1/many/get")
R_MANY_DELETE = ("POST", "/v1/many/delete")
R_STAT = ("GET", "/v1/stat")
R_WHO = ("GET", "/v1/who")
R_HEALTH = ("GET", "/healthz")
R_METRICS = ("GET", "/metrics")
R_SHARE = ("POST", "/v1/cuda/share")
R_LIVE = ("POST", "/v1/cuda/live")
R_OPENAPI = ("GET", "/openapi.json")
R_NONE = ("GET", "/nope")


def _exact(env: Env, later: int) -> Req:
    """A get of the version just put (``later``: of one never published)."""
    name = env.put()
    items = env.call("GET", "/v1/tensors").json()["items"]
    version = next(i["version"] for i in items if i["name"] == name) + later
    return env.req("GET", f"/v1/tensors/{quote(name)}?version={version}")


def _put_target(name: str, extra: str = "") -> str:
    return f"/v1/put/{quote(name)}?dtype=uint8&shape={NBYTES}{extra}"


GOOD = [
    pytest.param(
        Case(
            R_SESSIONS,
            lambda e: e.req("POST", "/v1/sessions", {"pid": 1}, session=False),
            200,
            delta={"sessions": 1},
            check=_session_made,
        ),
        id="sessions-open",
    ),
    pytest.param(
        Case(
            R_HEARTBEAT,
            lambda e: e.req("POST", f"/v1/sessions/{e.session()}/heartbeat", session=False),
            204,
        ),
        id="sessions-heartbeat",
    ),
    pytest.param(
        Case(R_FORK, _fork, 200, delta={"sessions": 1, "leases": 1}, check=_fork_made),
        id="sessions-fork",
    ),
    pytest.param(Case(R_CLAIM, _claim, 200), id="sessions-claim"),
    # A lane's descriptors go only over the unix socket's fast lane
    # (tests/e2e/test_shmlane.py): over TCP, every door refuses it alike.
    pytest.param(
        Case(R_LANE, lambda e: e.req("POST", "/v1/lane"), 400, "invalid_request"),
        id="sessions-lane-tcp",
    ),
    pytest.param(
        Case(R_CLOSE, _close_session, 204, delta={"sessions": -1, "leases": -1}),
        id="sessions-close",
    ),
    pytest.param(
        Case(R_LIST, lambda e: (e.put(), e.req("GET", "/v1/tensors"))[1], 200), id="tensors-list"
    ),
    pytest.param(Case(R_LIST, _listing, 200, check=_team_listing), id="tensors-list-team"),
    pytest.param(
        Case(
            R_GET, lambda e: e.req("GET", f"/v1/tensors/{quote(e.put())}"), 200, delta={"leases": 1}
        ),
        id="tensors-get",
    ),
    pytest.param(
        Case(R_GET, lambda e: e.req("GET", f"/v1/tensors/{quote(e.name())}"), 404, "not_found"),
        id="tensors-get-absent",
    ),
    pytest.param(
        Case(
            R_GET,
            lambda e: e.req("GET", f"/v1/tensors/{quote(e.put())}?timeout=nan"),
            422,
            "invalid_request",
        ),
        id="tensors-get-timeout-nan",
    ),
    pytest.param(
        Case(R_GET, lambda e: e.req("GET", "/v1/tensors/"), (400, 422), ANY),
        id="tensors-get-empty-name",
    ),
    pytest.param(
        Case(R_GET, lambda e: _exact(e, 0), 200, delta={"leases": 1}), id="tensors-get-version"
    ),
    pytest.param(
        Case(R_GET, lambda e: _exact(e, 1), 404, "not_found"), id="tensors-get-version-gone"
    ),
    pytest.param(
        Case(
            R_GET,
            lambda e: e.req("GET", f"/v1/tensors/{quote(e.put())}?version=1&timeout=1"),
            422,
            "invalid_request",
        ),
        id="tensors-get-version-and-timeout",
    ),
    pytest.param(
        Case(
            R_DELETE,
            lambda e: e.req("DELETE", f"/v1/tensors/{quote(e.put())}"),
            204,
            delta={"bytes_in_use": -NBYTES, "versions": -1, "tensors": -1},
            deleted=frozenset({"w"}),
        ),
        id="tensors-delete",
    ),
    pytest.param(
        Case(
            R_DELETE, lambda e: e.req("DELETE", f"/v1/tensors/{quote(e.name())}"), 404, "not_found"
        ),
        id="tensors-delete-absent",
    ),
    pytest.param(
        Case(
            R_PUT,
            lambda e: e.req(
                "POST", _put_target(e.name()), b"\0" * NBYTES, ctype="application/octet-stream"
            ),
            200,
            delta=PUT,
            created=frozenset({"w"}),
        ),
        id="put",
    ),
    pytest.param(
        Case(
            R_PUT, lambda e: e.req("POST", _put_target(e.name()), b"\0" * 3), 400, "invalid_request"
        ),
        id="put-short-body",
    ),
    pytest.param(
        Case(
            R_ALLOC,
            lambda e: e.req(
                "POST", "/v1/alloc", {"name": e.name(), "shape": [NBYTES], "dtype": "uint8"}
            ),
            200,
            delta=NEW,
            created=frozenset({"w"}),
        ),
        id="alloc",
    ),
    pytest.param(Case(R_PUBLISH, _publish, 200, delta={"tensors": 1}), id="publish"),
    pytest.param(
        Case(
            R_ABORT,
            _abort,
            204,
            delta={"bytes_in_use": -NBYTES, "versions": -1},
            deleted=frozenset({"w"}),
        ),
        id="abort",
    ),
    pytest.param(
        Case(R_LINK, _link, 200, delta={"versions": 1, "tensors": 1}, created=frozenset({"dst"})),
        id="link",
    ),
    pytest.param(
        Case(R_RELEASE, _release, 200, delta={"leases": -1}, check=released(1)), id="release"
    ),
    pytest.param(
        Case(
            R_RELEASE,
            lambda e: e.req("POST", "/v1/release", {"leases": "x"}),
            422,
            "invalid_request",
        ),
        id="release-not-a-list",
    ),
    # A batch names each tensor's device (host here; a GPU's whole handle
    # would come back in "others"); the bytes a put carries go to the host only.
    pytest.param(
        Case(
            R_MANY_ALLOC,
            lambda e: e.req("POST", "/v1/many/alloc", _many_alloc_body(e, ["cpu", "cpu:0"])),
            200,
            delta=TWO,
            created=frozenset("ab"),
        ),
        id="many-alloc-devices",
    ),
    pytest.param(
        Case(
            R_MANY_ALLOC,
            lambda e: e.req("POST", "/v1/many/alloc", _many_alloc_body(e, ["cpu"])),
            400,
            "invalid_request",
        ),
        id="many-alloc-a-device-short",
    ),
    pytest.param(
        Case(
            R_MANY_ALLOC,
            lambda e: e.req(
                "POST",
                "/v1/many/alloc",
                _many_alloc_body(e, ["cpu", NO_GPU]),
            ),
            (400, 404, 409, 422),
            ANY,
        ),
        id="many-alloc-on-a-gpu-it-lacks",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: e.req(
                "POST",
                "/v1/many/put",
                _framed(
                    _many_alloc_body(e, ["cpu", NO_GPU]),
                    b"\1" * 2 * NBYTES,
                ),
                ctype=OCTETS,
            ),
            400,
            "invalid_request",
        ),
        id="many-put-to-a-gpu",
    ),
    pytest.param(
        Case(
            R_MANY_ALLOC,
            lambda e: e.req("POST", "/v1/many/alloc", _many_alloc_body(e)),
            200,
            delta=TWO,
            created=frozenset("ab"),
        ),
        id="many-alloc",
    ),
    pytest.param(Case(R_MANY_PUBLISH, _many_publish, 200, delta={"tensors": 2}), id="many-publish"),
    pytest.param(
        Case(R_MANY_PUT, _many_put, 200, delta={**TWO, "tensors": 2}, created=frozenset("ab")),
        id="many-put",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: _many_put(e, ctype=None),
            200,
            delta={**TWO, "tensors": 2},
            created=frozenset("ab"),
        ),
        id="many-put-no-content-type",
    ),
    # Bad bodies: refused, and nothing is placed.
    pytest.param(
        Case(R_MANY_PUT, lambda e: _many_put(e, b"\1" * (2 * NBYTES - 1)), 400, "invalid_request"),
        id="many-put-short-body",
    ),
    pytest.param(
        Case(R_MANY_PUT, lambda e: _many_put(e, b"\1" * (2 * NBYTES + 1)), 400, "invalid_request"),
        id="many-put-long-body",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: e.req("POST", "/v1/many/put", b"\0\0", ctype=OCTETS),
            400,
            "invalid_request",
        ),
        id="many-put-no-head",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: e.req("POST", "/v1/many/put", b"\0\0\1\0{}", ctype=OCTETS),
            400,
            "invalid_request",
        ),
        id="many-put-head-cut",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: e.req("POST", "/v1/many/put", _framed([1, 2], b""), ctype=OCTETS),
            (400, 422),
            "invalid_request",
        ),
        id="many-put-head-not-an-object",
    ),
    pytest.param(
        Case(R_MANY_PUT, lambda e: _many_put(e, ctype=JSON), 400, "invalid_request"),
        id="many-put-as-json",
    ),
    pytest.param(
        Case(R_MANY_PUT, lambda e: _many_put(e, names=("a", "a")), 400, "invalid_request"),
        id="many-put-name-twice",
    ),
    pytest.param(
        Case(
            R_MANY_GET,
            lambda e: e.req("POST", "/v1/many/get", {"names": [e.put("a"), e.put("b")]}),
            200,
            delta={"leases": 2},
        ),
        id="many-get",
    ),
    pytest.param(
        Case(
            R_MANY_GET,
            lambda e: e.req("POST", "/v1/many/get", {"names": [e.name("absent")]}),
            404,
            "not_found",
        ),
        id="many-get-absent",
    ),
    pytest.param(
        Case(
            R_MANY_GET,
            lambda e: e.req(
                "POST",
                "/v1/many/get",
                {"names": [e.put("a"), e.put("b")], "newer_than": [0, 5], "wait": "any"},
            ),
            200,
            delta={"leases": 2},
        ),
        id="many-get-any",
    ),
    pytest.param(
        Case(R_MANY_GET, _known_get, 200, delta={"leases": 1}, check=_short),
        id="many-get-known",
    ),
    pytest.param(
        Case(
            R_MANY_GET,
            lambda e: e.req("POST", "/v1/many/get?known=-1", {"names": [e.put("a")]}),
            422,
            "invalid_request",
        ),
        id="many-get-known-not-a-key",
    ),
    pytest.param(
        Case(R_MANY_GET, _floored("?newer_than=0"), 200, delta={"leases": 1}),
        id="many-get-floor-query",
    ),
    pytest.param(
        Case(R_MANY_GET, _floored("?newer_than=999999999"), 404, "not_found"),
        id="many-get-floor-query-not-newer",
    ),
    pytest.param(
        Case(R_MANY_GET, _floored("?newer_than=0", [0]), 400, "invalid_request"),
        id="many-get-floor-twice",
    ),
    pytest.param(
        Case(R_MANY_GET, _floored("?newer_than=-1"), 422, "invalid_request"),
        id="many-get-floor-query-not-a-version",
    ),
    pytest.param(
        Case(
            R_MANY_DELETE,
            lambda e: e.req("POST", "/v1/many/delete", {"names": [e.put("a"), e.put("b")]}),
            200,
            delta={"bytes_in_use": -2 * NBYTES, "versions": -2, "tensors": -2},
            deleted=frozenset("ab"),
        ),
        id="many-delete",
    ),
    pytest.param(
        Case(
            R_MANY_DELETE,
            lambda e: e.req("POST", "/v1/many/delete", {"names": [e.put("a"), e.name("absent")]}),
            404,
            "not_found",
        ),
        id="many-delete-absent",
    ),
    pytest.param(
        Case(
            R_MANY_DELETE,
            lambda e: e.req(
                "POST", "/v1/many/delete", {"prefix": (e.put("a"), e.put("b"), e.name(""))[2]}
            ),
            200,
            delta={"bytes_in_use": -2 * NBYTES, "versions": -2, "tensors": -2},
            deleted=frozenset("ab"),
        ),
        id="many-delete-prefix",
    ),
    pytest.param(
        Case(
            R_MANY_DELETE,
            lambda e: e.req(
                "POST", "/v1/many/delete", {"names": [e.put("a")], "prefix": e.name("")}
            ),
            (400, 422),
            "invalid_request",
        ),
        id="many-delete-both",
    ),
    pytest.param(Case(R_STAT, lambda e: e.req("GET", "/v1/stat", session=False), 200), id="stat"),
    pytest.param(Case(R_WHO, lambda e: e.req("GET", "/v1/who", session=False), 200), id="who"),
    pytest.param(
        Case(R_HEALTH, lambda e: e.req("GET", "/healthz", who=None), 200, check=_health),
        id="healthz",
    ),
    pytest.param(
        Case(
            R_METRICS, lambda e: e.req("GET", "/metrics", session=False), 200, check=_metrics_text
        ),
        id="metrics",
    ),
    # Without a GPU (or with a handle no driver knows) a share is refused, cleanly.
    pytest.param(
        Case(
            R_SHARE,
            lambda e: e.req("POST", "/v1/cuda/share", _share_body(e)),
            (400, 404, 409, 422),
            ANY,
        ),
        id="cuda-share",
    ),
    pytest.param(
        Case(R_LIVE, lambda e: e.req("POST", "/v1/cuda/live", {"segments": ["x"]}), 200),
        id="cuda-live",
    ),
    pytest.param(
        Case(R_OPENAPI, lambda e: e.req("GET", "/openapi.json", session=False), 200), id="openapi"
    ),
    pytest.param(
        Case(R_NONE, lambda e: e.req("GET", "/nope", session=False), 404, "no_such_route"),
        id="no-such-route",
    ),
    pytest.param(
        Case(
            R_GET,
            lambda e: e.req("GET", f"/v1/tensors/{quote(e.put())}", who=UNIX),
            200,
            delta={"leases": 1},
        ),
        id="tensors-get-unix",
    ),
]

# -- names with control characters: refused, and nothing else named instead ------------------

CONTROL = {"newline": "\n", "tab": "\t", "nul": "\0", "cr": "\r", "space": " "}


def _bad(env: Env, c: str) -> str:
    """The name "w" followed by ``c``; "w" itself exists, so a door that
    cuts the name at ``c`` touches it."""
    env.put()
    return env.name("w" + c)


def _control_cases() -> Iterator[Any]:
    for label, c in CONTROL.items():
        yield pytest.param(
            Case(
                R_GET,
                lambda e, c=c: e.req("GET", f"/v1/tensors/{quote(_bad(e, c))}"),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-get",
        )
        # A ttl: a door that wrongly makes "w\n" leaves no name that no path can delete.
        yield pytest.param(
            Case(
                R_PUT,
                lambda e, c=c: e.req("POST", _put_target(_bad(e, c), "&ttl=1"), b"\0" * NBYTES),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-put",
        )
        yield pytest.param(
            Case(
                R_DELETE,
                lambda e, c=c: e.req("DELETE", f"/v1/tensors/{quote(_bad(e, c))}"),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-delete",
        )
        yield pytest.param(
            Case(
                R_ALLOC,
                lambda e, c=c: e.req(
                    "POST", "/v1/alloc", {"name": _bad(e, c), "shape": [NBYTES], "dtype": "uint8"}
                ),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-alloc-body",
        )
        yield pytest.param(
            Case(
                R_MANY_GET,
                lambda e, c=c: e.req("POST", "/v1/many/get", {"names": [_bad(e, c)]}),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-many-get-body",
        )
        yield pytest.param(
            Case(
                R_MANY_ALLOC,
                lambda e, c=c: e.req(
                    "POST",
                    "/v1/many/alloc",
                    {"names": [_bad(e, c)], "shapes": [[NBYTES]], "dtypes": ["uint8"]},
                ),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-many-alloc-body",
        )
        yield pytest.param(
            Case(
                R_MANY_PUT,
                lambda e, c=c: e.req(
                    "POST",
                    "/v1/many/put",
                    _framed(
                        {"names": [_bad(e, c)], "shapes": [[NBYTES]], "dtypes": ["uint8"]},
                        b"\0" * NBYTES,
                    ),
                    ctype=OCTETS,
                ),
                400,
                "invalid_request",
            ),
            id=f"name-{label}-many-put-head",
        )


# -- limits: bodies over MAX_BODY_BYTES, heads over MAX_HEADER_BYTES -----------------------------

PAD = b" " * (MAX_BODY_BYTES + 1)


def _too_big(route: tuple[str, str], make: Callable[[Env], tuple[str, bytes]], chunk: bool) -> Case:
    def prepare(env: Env) -> Req:
        target, body = make(env)
        return env.req(route[0], target, body, chunk=chunk)

    return Case(route, prepare, 413, "too_large")


def _json_padded(obj: Any) -> bytes:
    text = json.dumps(obj).encode()
    return text[:-1] + PAD + text[-1:]  # still valid JSON: a door that reads it all would accept it


def _big_release(env: Env) -> tuple[str, bytes]:
    return "/v1/release", _json_padded({"leases": [env.lease(env.put())]})


def _big_alloc(env: Env) -> tuple[str, bytes]:
    return "/v1/alloc", _json_padded({"name": env.name(), "shape": [NBYTES], "dtype": "uint8"})


def _big_many_get(env: Env) -> tuple[str, bytes]:
    return "/v1/many/get", _json_padded({"names": [env.put()]})


def _big_put(env: Env) -> tuple[str, bytes]:
    return _put_target(env.name()), PAD


def _limit_cases() -> Iterator[Any]:
    for chunk, how in ((False, "length"), (True, "chunked")):
        yield pytest.param(_too_big(R_RELEASE, _big_release, chunk), id=f"body-413-{how}-release")
        yield pytest.param(_too_big(R_ALLOC, _big_alloc, chunk), id=f"body-413-{how}-alloc")
        yield pytest.param(
            _too_big(R_MANY_GET, _big_many_get, chunk), id=f"body-413-{how}-many-get"
        )
        yield pytest.param(_too_big(R_PUT, _big_put, chunk), id=f"body-413-{how}-put")
    big = (("x-padding", "a" * (100 << 10)),)  # one 100 KiB header, written in one sendall
    assert len(big[0][1]) > MAX_HEADER_BYTES
    for who, via in (("admin", "tcp"), (UNIX, "unix")):
        yield pytest.param(
            Case(
                R_STAT,
                lambda e, who=who: e.req("GET", "/v1/stat", session=False, headers=big, who=who),
                431,
                "too_large",
            ),
            id=f"head-431-{via}-stat",
        )
        yield pytest.param(
            Case(
                R_GET,
                lambda e, who=who: e.req(
                    "GET", f"/v1/tensors/{quote(e.put())}", headers=big, who=who
                ),
                431,
                "too_large",
            ),
            id=f"head-431-{via}-get",
        )
        yield pytest.param(
            Case(
                R_PUT,
                lambda e, who=who: e.req(
                    "POST", _put_target(e.name()), b"\0" * NBYTES, headers=big, who=who
                ),
                431,
                "too_large",
            ),
            id=f"head-431-{via}-put",
        )


# -- bodies that are not JSON, or not the JSON a route reads --------------------------------------


def _encodings() -> dict[str, Callable[[bytes], tuple[bytes, str]]]:
    return {
        "text-plain": lambda b: (b, "text/plain"),
        "form": lambda b: (b, "application/x-www-form-urlencoded"),
        "invalid-json": lambda b: (b[:-1], JSON),
        "utf16": lambda b: (b.decode().encode("utf-16"), JSON),  # with a BOM
        "utf16le": lambda b: (b.decode().encode("utf-16-le"), JSON),  # without one
        "utf8-bom": lambda b: (b"\xef\xbb\xbf" + b, JSON),
        "latin1": lambda b: (b.replace(b"{", b'{"caf\xe9": 0, ', 1), JSON),  # not UTF-8
        "nested-10000": lambda b: (
            b.replace(b"[", b"[" * 10000, 1).replace(b"]", b"]" * 10000, 1),
            JSON,
        ),
        "int-5000-digits": lambda b: (b.replace(b"[", b"[" + b"9" * 5000 + b",", 1), JSON),
    }


def _json_routes() -> dict[str, tuple[tuple[str, str], Callable[[Env], bytes], Mapping[str, int]]]:
    """Route -> (its operation, a good body, what that body would change)."""
    return {
        "release": (
            R_RELEASE,
            lambda e: json.dumps({"leases": [e.lease(e.put())]}).encode(),
            {"leases": -1},
        ),
        "many-get": (
            R_MANY_GET,
            lambda e: json.dumps({"names": [e.put()]}).encode(),
            {"leases": 1},
        ),
        "alloc": (
            R_ALLOC,
            lambda e: json.dumps({"shape": [NBYTES], "name": e.name(), "dtype": "uint8"}).encode(),
            NEW,
        ),
    }


def _encoding_cases() -> Iterator[Any]:
    for route_id, (route, good, _) in _json_routes().items():
        for enc_id, enc in _encodings().items():

            def prepare(
                env: Env,
                good: Callable[[Env], bytes] = good,
                enc: Callable[[bytes], tuple[bytes, str]] = enc,
                route: tuple[str, str] = route,
            ) -> Req:
                body, ctype = enc(good(env))
                return env.req(route[0], route[1], body, ctype=ctype)

            yield pytest.param(
                Case(route, prepare, (400, 422), ANY), id=f"body-{enc_id}-{route_id}"
            )


# -- who may: no token, a wrong token, a read token, a token for another prefix --------------------


def _scope_cases() -> Iterator[Any]:
    def put_body(env: Env) -> Req:
        return env.req("POST", _put_target(env.name()), b"\0" * NBYTES, who="read")

    writes: dict[str, tuple[tuple[str, str], Callable[[Env], Req]]] = {
        "put": (R_PUT, put_body),
        "delete": (
            R_DELETE,
            lambda e: e.req("DELETE", f"/v1/tensors/{quote(e.put())}", who="read"),
        ),
        "alloc": (
            R_ALLOC,
            lambda e: e.req(
                "POST",
                "/v1/alloc",
                {"name": e.name(), "shape": [NBYTES], "dtype": "uint8"},
                who="read",
            ),
        ),
        "publish": (R_PUBLISH, lambda e: e.req("POST", "/v1/publish", _written(e), who="read")),
        "abort": (R_ABORT, lambda e: e.req("POST", "/v1/abort", _written(e), who="read")),
        "link": (
            R_LINK,
            lambda e: e.req(
                "POST",
                "/v1/link",
                {"name": e.name("dst"), "lease": e.lease(e.put(), who="read")},
                who="read",
            ),
        ),
        "many-alloc": (
            R_MANY_ALLOC,
            lambda e: e.req(
                "POST",
                "/v1/many/alloc",
                {"names": [e.name()], "shapes": [[NBYTES]], "dtypes": ["uint8"]},
                who="read",
            ),
        ),
        "many-publish": (
            R_MANY_PUBLISH,
            lambda e: e.req(
                "POST", "/v1/many/publish", {"names": [e.alloc()[0]], "versions": [1]}, who="read"
            ),
        ),
        "many-put": (R_MANY_PUT, lambda e: _many_put(e, who="read")),
        "cuda-share": (
            R_SHARE,
            lambda e: e.req("POST", "/v1/cuda/share", _share_body(e), who="read"),
        ),
    }
    for route_id, (route, prepare) in writes.items():
        yield pytest.param(Case(route, prepare, 403, "forbidden"), id=f"scope-read-{route_id}")

    def anonymous(
        route: tuple[str, str],
        target: Callable[[Env], str],
        body: Callable[[Env], Any],
        token: str | None,
    ) -> Callable[[Env], Req]:
        def prepare(env: Env) -> Req:
            headers = () if token is None else (("Authorization", token),)
            return env.req(route[0], target(env), body(env), who=None, headers=headers)

        return prepare

    for how, token in (
        ("none", None),
        ("wrong", "Bearer not-a-token-of-this-broker"),
        ("basic", "Basic b3BzOnNlY3JldA=="),
    ):
        for route_id, route, target, body in (
            ("get", R_GET, lambda e: f"/v1/tensors/{quote(e.put())}", lambda e: None),
            ("put", R_PUT, lambda e: _put_target(e.name()), lambda e: b"\0" * NBYTES),
            ("release", R_RELEASE, lambda e: "/v1/release", lambda e: {"leases": []}),
            ("many-get", R_MANY_GET, lambda e: "/v1/many/get", lambda e: {"names": [e.put()]}),
            ("stat", R_STAT, lambda e: "/v1/stat", lambda e: None),
            (
                "alloc",
                R_ALLOC,
                lambda e: "/v1/alloc",
                lambda e: {"name": e.name(), "shape": [1], "dtype": "uint8"},
            ),
            ("sessions", R_SESSIONS, lambda e: "/v1/sessions", lambda e: {"pid": 1}),
        ):
            yield pytest.param(
                Case(route, anonymous(route, target, body, token), 401, "unauthorized"),
                id=f"token-{how}-{route_id}",
            )

    outside: dict[str, tuple[tuple[str, str], Callable[[Env], Req]]] = {
        "get-path": (R_GET, lambda e: e.req("GET", f"/v1/tensors/{quote(e.put())}", who="team")),
        "put-path": (
            R_PUT,
            lambda e: e.req("POST", _put_target(e.name()), b"\0" * NBYTES, who="team"),
        ),
        "delete-path": (
            R_DELETE,
            lambda e: e.req("DELETE", f"/v1/tensors/{quote(e.put())}", who="team"),
        ),
        "alloc-body": (
            R_ALLOC,
            lambda e: e.req(
                "POST",
                "/v1/alloc",
                {"name": e.name(), "shape": [NBYTES], "dtype": "uint8"},
                who="team",
            ),
        ),
        "many-alloc-body": (
            R_MANY_ALLOC,
            lambda e: e.req(
                "POST",
                "/v1/many/alloc",
                {
                    "names": [e.name("ok", team=True), e.name()],
                    "shapes": [[NBYTES], [NBYTES]],
                    "dtypes": ["uint8", "uint8"],
                },
                who="team",
            ),
        ),
        "many-get-body": (
            R_MANY_GET,
            lambda e: e.req("POST", "/v1/many/get", {"names": [e.put()]}, who="team"),
        ),
        "many-put-head": (
            R_MANY_PUT,
            lambda e: e.req(
                "POST",
                "/v1/many/put",
                _framed(
                    {
                        "names": [e.name("ok", team=True), e.name()],
                        "shapes": [[NBYTES], [NBYTES]],
                        "dtypes": ["uint8", "uint8"],
                    },
                    b"\0" * 2 * NBYTES,
                ),
                who="team",
                ctype=OCTETS,
            ),
        ),
        "publish-body": (
            R_PUBLISH,
            lambda e: e.req("POST", "/v1/publish", _written(e), who="team"),
        ),
        "link-body": (
            R_LINK,
            lambda e: e.req(
                "POST",
                "/v1/link",
                {
                    "name": e.name("dst"),
                    "lease": e.lease(e.put("src", who="team", team=True), who="team"),
                },
                who="team",
            ),
        ),
    }
    for route_id, (route, prepare) in outside.items():
        yield pytest.param(Case(route, prepare, 403, "forbidden"), id=f"prefix-{route_id}")
    yield pytest.param(
        Case(
            R_PUT,
            lambda e: e.req("POST", _put_target(e.name(team=True)), b"\0" * NBYTES, who="team"),
            200,
            delta=PUT,
            created=frozenset({TEAM + "w"}),
        ),
        id="prefix-put-inside",
    )
    yield pytest.param(
        Case(
            R_MANY_GET,
            lambda e: e.req("POST", "/v1/many/get", {"names": [e.put(team=True)]}, who="team"),
            200,
            delta={"leases": 1},
        ),
        id="prefix-many-get-inside",
    )
    yield pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: _many_put(e, who="team", team=True),
            200,
            delta={**TWO, "tensors": 2},
            created=frozenset({TEAM + "a", TEAM + "b"}),
        ),
        id="prefix-many-put-inside",
    )


# -- release riders, stale releases, resends -------------------------------------------------------


def _rider(env: Env, target: str, obj: Any = None, method: str = "GET", **kw: Any) -> Req:
    lease = env.lease(env.put("held"))
    return env.req(method, target, obj, headers=((RELEASE_HEADER, str(lease)),), **kw)


def _foreign_rider(env: Env) -> Req:
    """The write token sends the admin's session and lease: not its own."""
    lease = env.lease(env.put())
    return env.req(
        "GET",
        "/v1/stat",
        who="write",
        sid=env.session("admin"),
        headers=((RELEASE_HEADER, str(lease)),),
    )


def _foreign_lease(env: Env) -> Req:
    """Its own session, with a lease id of another session: nothing is released."""
    lease = env.lease(env.put())
    env.session("write")
    return env.req("GET", "/v1/stat", who="write", headers=((RELEASE_HEADER, str(lease)),))


def _stale(env: Env) -> Req:
    sid, lease, retired = env.depot.lapsed(env.door)
    env.values["retired"] = retired
    return env.req("POST", "/v1/release", {"stale": {sid: [lease]}}, who="write")


def _replay(route: tuple[str, str], body: Callable[[Env], tuple[str, Any]]) -> Callable[[Env], Req]:
    def prepare(env: Env) -> Req:
        target, obj = body(env)
        return env.req(
            route[0], target, obj, headers=((REQUEST_HEADER, f"rid-{env.ns}"),), repeat=2
        )

    return prepare


RIDERS = [
    pytest.param(
        Case(R_STAT, lambda e: _rider(e, "/v1/stat"), 200, delta={"leases": -1}), id="rider-stat"
    ),
    pytest.param(
        Case(
            R_GET,
            lambda e: _rider(e, f"/v1/tensors/{quote(e.name('absent'))}"),
            404,
            "not_found",
            delta={"leases": -1},
        ),
        id="rider-get-absent",
    ),
    pytest.param(
        Case(
            R_MANY_GET,
            lambda e: _rider(e, "/v1/many/get", {"names": []}, "POST"),
            200,
            delta={"leases": -1},
        ),
        id="rider-many-get-empty",
    ),
    pytest.param(
        Case(
            R_RELEASE,
            lambda e: _rider(e, "/v1/release", {"leases": []}, "POST"),
            200,
            delta={"leases": -1},
            check=released(0),
        ),
        id="rider-release-empty",
    ),
    pytest.param(
        Case(R_LIST, lambda e: _rider(e, "/v1/tensors"), 200, delta={"leases": -1}), id="rider-list"
    ),
    pytest.param(Case(R_STAT, _foreign_rider, (200, 403), ANY), id="rider-foreign-session"),
    pytest.param(Case(R_STAT, _foreign_lease, 200), id="rider-foreign-lease"),
    pytest.param(
        Case(
            R_RELEASE,
            _stale,
            200,
            delta=lambda e: {"bytes_retired": -e.values["retired"]},
            check=released(1),
        ),
        id="release-stale",
    ),
    pytest.param(
        Case(
            R_ALLOC,
            _replay(
                R_ALLOC,
                lambda e: ("/v1/alloc", {"name": e.name(), "shape": [NBYTES], "dtype": "uint8"}),
            ),
            200,
            delta=NEW,
            created=frozenset({"w"}),
        ),
        id="replay-alloc",
    ),
    pytest.param(
        Case(
            R_PUT,
            _replay(R_PUT, lambda e: (_put_target(e.name()), b"\0" * NBYTES)),
            200,
            delta=PUT,
            created=frozenset({"w"}),
        ),
        id="replay-put",
    ),
    pytest.param(
        Case(
            R_GET,
            _replay(R_GET, lambda e: (f"/v1/tensors/{quote(e.put())}", None)),
            200,
            delta={"leases": 1},
        ),
        id="replay-get",
    ),
    pytest.param(
        Case(
            R_MANY_ALLOC,
            _replay(R_MANY_ALLOC, lambda e: ("/v1/many/alloc", _many_alloc_body(e))),
            200,
            delta=TWO,
            created=frozenset("ab"),
        ),
        id="replay-many-alloc",
    ),
    pytest.param(
        Case(
            R_MANY_PUT,
            lambda e: e.req(
                "POST",
                "/v1/many/put",
                _many_put(e).body,
                ctype=OCTETS,
                headers=((REQUEST_HEADER, f"rid-{e.ns}"),),
                repeat=2,
            ),
            200,
            delta={**TWO, "tensors": 2},
            created=frozenset("ab"),
        ),
        id="replay-many-put",
    ),
]

# A raw byte >= 0x80 in the path is no valid request; it is still an answer of the broker's.
ODD = [
    pytest.param(
        Case(R_GET, lambda e: e.req("GET", b"/v1/tensors/\xe9", session=False), 400, ANY),
        id="path-raw-byte",
    ),
]


def _same_cases() -> Iterator[Any]:
    """``same`` takes integers only: never a float, a string or a boolean
    that lax coercion would turn into a position."""
    for label, value in (("float", 0.0), ("string", "0"), ("bool", True)):

        def body(e: Env, value: Any = value) -> dict[str, Any]:
            return {**_many_alloc_body(e), "same": [-1, value]}

        yield pytest.param(
            Case(
                R_MANY_ALLOC,
                lambda e, body=body: e.req("POST", "/v1/many/alloc", body(e)),
                422,
                "invalid_request",
            ),
            id=f"many-alloc-same-{label}",
        )
        yield pytest.param(
            Case(
                R_MANY_PUT,
                lambda e, body=body: e.req(
                    "POST", "/v1/many/put", _framed(body(e), b"\1" * NBYTES), ctype=OCTETS
                ),
                (400, 422),
                "invalid_request",
            ),
            id=f"many-put-same-{label}",
        )


CASES = [
    *GOOD,
    *_control_cases(),
    *_limit_cases(),
    *_encoding_cases(),
    *_scope_cases(),
    *_same_cases(),
    *RIDERS,
    *ODD,
]


# -- the tests ---------------------------------------------------------------------------------


def _template(path: str) -> str:
    return path.replace(":path}", "}")


def test_every_route_has_a_case(depot: Depot) -> None:
    a = depot.send("GET", "/openapi.json")
    assert a.status == 200, a
    operations = {(m.upper(), _template(p)) for p, ops in a.json()["paths"].items() for m in ops}
    assert len(operations) >= 20, operations
    covered = {p.values[0].route for p in CASES}
    missing = sorted(operations - covered)
    assert not missing, f"routes without a case in the table: {missing}"


@pytest.mark.parametrize("case", CASES)
def test_every_door_agrees(depot: Depot, case: Case) -> None:
    seen: dict[str, Seen] = {}
    envs: dict[str, Env] = {}
    for door in [*DOORS, SHM]:
        got = run(depot, case, door)
        if got is not None:
            seen[door], envs[door] = got
    table = "\n".join(f"  {door:>6}: {s}" for door, s in seen.items())
    wrong = [door for door in seen if not case.matches(envs[door], seen[door])]
    agree = (
        len({(s.status, s.code, s.delta, s.created, s.deleted, s.keys) for s in seen.values()}) == 1
    )
    print(f"{case.route[0]} {case.route[1]}\n{table}")  # shown by pytest -rP
    assert not wrong and agree, (
        f"{case.route[0]} {case.route[1]}: expected {case.wanted(envs['lane'])}"
        f"{'' if agree else ' (and the doors disagree)'}\n{table}"
    )
