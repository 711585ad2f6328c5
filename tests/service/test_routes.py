"""Route tests through FastAPI's TestClient: error paths, the OpenAPI
document, and a fuzz test that throws malformed input at every route.

``with TestClient(create_app(settings))`` runs the real lifespan, so every
app here owns a real pool under its own segment prefix; the fixture checks
that /dev/shm holds nothing of it afterwards.  TestClient is not a unix
socket: it is a TCP peer, so the apps here run with --insecure-no-auth unless
they are given a token.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote

import jsonschema
import pytest
from _harness import TEST_PREFIX, shm_entries, wait_for
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordepot.service import Broker, Settings, create_app
from tensordepot.service._http._routes import ROUTES
from tensordepot.shm import DTYPES

MiB = 1 << 20
MAX_MEMORY = 8 * MiB
SESSION = "x-tensordepot-session"
RELEASE = "x-tensordepot-release"
ERROR_STATUSES = {"400", "401", "403", "404", "409", "422", "503", "507"}


class App:
    """A TestClient with the broker behind it and a session of this process."""

    def __init__(self, tc: TestClient, prefix: str, *, session: bool = True) -> None:
        self.tc = tc
        self.prefix = prefix
        self.sid = self.open_session() if session else ""

    @property
    def broker(self) -> Broker:
        broker: Broker = self.tc.app.state.broker  # type: ignore[attr-defined]
        return broker

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the app's event loop: the broker is not thread-safe."""
        assert self.tc.portal is not None
        return self.tc.portal.call(fn, *args)

    def open_session(self) -> str:
        r = self.tc.post("/v1/sessions", json={"pid": os.getpid(), "label": "routes"})
        assert r.status_code == 200, r.text
        sid: str = r.json()["session"]
        return sid

    def headers(self, sid: str | None = None) -> dict[str, str]:
        return {SESSION: sid or self.sid}

    def alloc(
        self, name: str, shape: list[int], dtype: str = "float32", sid: str | None = None
    ) -> Any:
        return self.tc.post(
            "/v1/alloc",
            json={"name": name, "shape": shape, "dtype": dtype},
            headers=self.headers(sid),
        )

    def put(self, name: str, data: bytes, shape: str, dtype: str = "uint8") -> Any:
        return self.tc.post(
            f"/v1/put/{quote(name, safe='')}",
            params={"dtype": dtype, "shape": shape},
            content=data,
            headers=self.headers(),
        )


def small_settings(prefix: str, **overrides: Any) -> Settings:
    """A small broker under its own prefix; the listen URL is never bound."""
    kw: dict[str, Any] = {
        "listen": ["unix:///nonexistent/broker.sock"],
        "shm_prefix": prefix,
        "max_memory": str(MAX_MEMORY),
        "segment_size": "1MiB",
        "prealloc": "0",
        "warm_memory": "2MiB",
        "token": "",
        "shm_group": "",
        "insecure_no_auth": not overrides.get("token"),
    }
    return Settings(**{**kw, **overrides})


@pytest.fixture
def make_app() -> Iterator[Callable[..., App]]:
    made: list[tuple[TestClient, str]] = []

    def make(**overrides: Any) -> App:
        prefix = f"{TEST_PREFIX}routes-{secrets.token_hex(4)}-"
        tc = TestClient(create_app(small_settings(prefix, **overrides)))
        tc.__enter__()
        made.append((tc, prefix))
        return App(tc, prefix, session=not overrides.get("token"))

    yield make
    for tc, prefix in made:
        tc.__exit__(None, None, None)
        left = shm_entries(prefix)
        for entry in left:
            os.unlink(os.path.join("/dev/shm", entry))
        assert left == [], f"the app left segments in /dev/shm: {left}"


@pytest.fixture
def app(make_app: Callable[..., App]) -> App:
    return make_app()


def assert_error(r: Any, status: int, code: str | None = None, match: str = "") -> dict[str, str]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message"}, body
    assert isinstance(err["code"], str) and err["code"], body
    assert isinstance(err["message"], str) and err["message"], body
    if code is not None:
        assert err["code"] == code, body
    if match:
        assert match in err["message"], body
    return dict(err)


def live_versions(broker: Broker) -> set[Any]:
    """Every version that should hold memory: named ones, leased ones, and
    unpublished writes whose name was deleted meanwhile."""
    live = set()
    for e in broker.entries.values():
        live |= set(e.writing.values())
        if e.ready is not None:
            live.add(e.ready)
    live |= {v for lease in broker.leases.values() for v in lease.versions}
    for s in broker.sessions.values():
        live |= s.writing
    return live


def check_accounting(broker: Broker) -> None:
    """The broker's books agree with its state, its pool and /dev/shm."""
    live = live_versions(broker)
    assert all(v.block is not None for v in live), "a live version lost its memory"
    assert broker.versions_live == len(live)
    blocks = {id(v.block): v.block for v in live}  # versions may share a block (link)
    for block in blocks.values():
        sharing = sum(1 for v in live if v.block is block)
        assert getattr(block, "refs", 1) == sharing, "a block's reference count is off"
    assert broker.bytes_in_use == sum(b.nbytes for b in blocks.values())
    pool = broker.pool
    assert pool.used == sum(b.size for b in blocks.values())
    assert pool.reserved <= pool.max_memory
    # A dropped segment is unlinked on the broker's one unlink thread, after
    # the answer that dropped it: what that thread was handed is done first.
    broker.memory._unlinker.submit(lambda: None).result(timeout=10)
    on_disk = {e for e in shm_entries(pool.prefix) if not e.endswith("lock")}
    assert on_disk == set(pool.segment_names())
    for lid, lease in broker.leases.items():
        assert lease.session in broker.sessions, "a lease outlived its session"
        assert lid in broker.sessions[lease.session].leases
    for s in broker.sessions.values():
        assert s.leases <= set(broker.leases)
    for v in live:
        assert v.readers == sum(1 for lease in broker.leases.values() if v in lease.versions)


# -- error paths --------------------------------------------------------------

OVERFLOW = [2**31, 2**31, 4]  # 2**64 bytes of float32: no quota could hold it


def test_bad_input_is_400(app: App) -> None:
    assert_error(app.alloc("x", [2], "complex512"), 400, "invalid_request", "complex512")
    r = app.tc.post(
        "/v1/alloc",
        json={"name": "x", "shape": [2], "dtype": "float32", "device": "tpu:7"},
        headers=app.headers(),
    )
    assert_error(r, 400, "invalid_request", "tpu:7")
    r = app.tc.post("/v1/alloc", json={"name": "x", "shape": [2], "dtype": "float32"})
    assert_error(r, 400, "invalid_request", "needs a session")
    assert_error(app.put("p", b"abc", "4"), 400, "invalid_request", "3 bytes")
    assert_error(app.put("p", b"abc", "3,x"), 400, "invalid_request")
    assert_error(app.put("p", bytes(300_000), "300000"), 400, "invalid_request", "at most")
    check_accounting(app.broker)
    assert app.broker.bytes_in_use == 0


@pytest.mark.parametrize(
    "shape,dtype",
    [
        pytest.param(OVERFLOW, "float32", id="2**64-bytes"),
        pytest.param([2**62, 2], "uint8", id="2**63-bytes"),
        pytest.param([10**30], "float64", id="10**31-bytes"),
        pytest.param([2**40, 2**40, 0, 2**40], "float32", id="zero-dim-between-huge"),
    ],
)
def test_overflowing_byte_counts_are_400_not_507(app: App, shape: list[int], dtype: str) -> None:
    assert_error(app.alloc("huge", shape, dtype), 400, "invalid_request")
    dims = ",".join(str(d) for d in shape)
    assert_error(app.put("huge", b"", dims, dtype), 400, "invalid_request")
    r = app.tc.post(
        "/v1/many/alloc",
        json={"names": ["ok", "huge"], "shapes": [[4], shape], "dtypes": ["uint8", dtype]},
        headers=app.headers(),
    )
    assert_error(r, 400, "invalid_request")
    r = app.tc.post(
        "/v1/many/alloc",
        json={"names": ["ok", "huge"], "shapes": [[4], shape], "dtypes": ["uint8", dtype]},
        headers=app.headers(),
    )
    assert_error(r, 400, "invalid_request")
    check_accounting(app.broker)
    assert app.broker.bytes_in_use == 0 and app.broker.entries == {}, (
        "a failed batch leaves nothing"
    )


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"{not json", id="malformed-json"),
        pytest.param(b"", id="empty-body"),
        pytest.param(b"[1, 2]", id="not-an-object"),
        pytest.param(b'{"name": "x"}', id="missing-fields"),
        pytest.param(b'{"name": "x", "shape": [-1], "dtype": "uint8"}', id="negative-dim"),
        pytest.param(b'{"name": "x", "shape": [1.5], "dtype": "uint8"}', id="fractional-dim"),
        pytest.param(
            json.dumps({"name": "x", "shape": [1] * 33, "dtype": "uint8"}).encode(), id="33-dims"
        ),
        pytest.param(
            b'{"name": "x", "shape": [1], "dtype": "uint8", "bogus": 1}', id="extra-field"
        ),
        pytest.param(b'{"name": "x", "shape": [1], "dtype": "uint8", "ttl": 0}', id="zero-ttl"),
        pytest.param(b'{"name": "x", "shape": [1], "dtype": "uint8", "ttl": NaN}', id="nan-ttl"),
    ],
)
def test_malformed_bodies_are_422(app: App, body: bytes) -> None:
    r = app.tc.post(
        "/v1/alloc", content=body, headers={**app.headers(), "content-type": "application/json"}
    )
    assert_error(r, 422, "invalid_request")
    assert app.broker.bytes_in_use == 0


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("has space", id="space"),
        pytest.param("", id="empty"),
        pytest.param("x" * 513, id="long"),
        pytest.param("w\n", id="newline"),
        pytest.param("w\x00", id="nul"),
    ],
)
def test_a_bad_name_in_a_body_is_400_as_in_a_path(app: App, name: str) -> None:
    """One name check (``check_name``) for names in bodies and in paths."""
    body = json.dumps({"name": name, "shape": [1], "dtype": "uint8"}).encode()
    r = app.tc.post(
        "/v1/alloc", content=body, headers={**app.headers(), "content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request")
    assert "is not a valid tensor name" in r.json()["error"]["message"]
    assert app.broker.bytes_in_use == 0


@pytest.mark.parametrize(
    "method,path",
    [
        pytest.param("GET", "/v1/tensors/x?timeout=-1", id="negative-timeout"),
        pytest.param("GET", "/v1/tensors/x?timeout=soon", id="word-timeout"),
        pytest.param("GET", "/v1/tensors/x?timeout=nan", id="nan-timeout"),
        pytest.param("GET", "/v1/tensors/x?newer_than=-1", id="negative-newer-than"),
        pytest.param("GET", "/v1/tensors/x?newer_than=1.5", id="fractional-newer-than"),
        pytest.param("POST", "/v1/put/x?shape=4", id="put-without-dtype"),
        pytest.param("POST", "/v1/put/x?dtype=uint8&shape=4&ttl=-1", id="put-negative-ttl"),
    ],
)
def test_bad_query_parameters_are_422(app: App, method: str, path: str) -> None:
    r = app.tc.request(method, path, headers=app.headers(), content=b"abcd")
    assert_error(r, 422, "invalid_request")


def test_token_is_required_off_the_unix_socket(make_app: Callable[..., App]) -> None:
    token = secrets.token_urlsafe(16)
    app = make_app(token=token)
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": token},
        {"authorization": f"Basic {token}"},
    ):
        for method, path in (
            ("GET", "/v1/stat"),
            ("GET", "/v1/tensors"),
            ("POST", "/v1/sessions"),
            ("GET", "/metrics"),
            ("DELETE", "/v1/tensors/x"),
        ):
            r = app.tc.request(method, path, headers=headers, json={"pid": 1})
            assert_error(r, 401, "unauthorized", "Authorization: Bearer")
    ok = {"authorization": f"Bearer {token}"}
    assert app.tc.get("/v1/stat", headers=ok).status_code == 200
    r = app.tc.post("/v1/sessions", json={"pid": os.getpid()}, headers=ok)
    assert r.status_code == 200 and r.json()["session"]


def test_unknown_name_is_404(app: App) -> None:
    app.put("present", b"\x01", "1")
    assert_error(
        app.tc.get("/v1/tensors/missing", headers=app.headers()), 404, "not_found", "known: present"
    )
    assert_error(
        app.tc.get("/v1/tensors/missing?timeout=0.01", headers=app.headers()),
        404,
        "timed_out",
        "not published within",
    )
    assert_error(app.tc.delete("/v1/tensors/missing"), 404, "not_found")
    r = app.tc.post("/v1/publish", json={"name": "missing", "version": 1}, headers=app.headers())
    assert_error(r, 404, "not_found")
    r = app.tc.post("/v1/abort", json={"name": "present", "version": 1}, headers=app.headers())
    assert_error(r, 404, "not_found")
    r = app.tc.post("/v1/many/get", json={"names": ["present", "missing"]}, headers=app.headers())
    assert_error(r, 404, "not_found")
    assert app.broker.leases == {}, "a failed batch get holds no lease"
    for gone in ("get", "alloc", "publish"):  # one batch protocol: /v1/many/*
        assert_error(
            app.tc.post(f"/v1/batch/{gone}", json={"names": ["present"]}, headers=app.headers()),
            404,
            "no_such_route",
        )
    r = app.tc.post(
        "/v1/many/get", json={"names": ["present"], "newer_than": [1, 2]}, headers=app.headers()
    )
    assert_error(r, 400, "invalid_request", "one per name")
    r = app.tc.post(
        "/v1/many/publish", json={"names": ["present"], "versions": [1, 2]}, headers=app.headers()
    )
    assert_error(r, 400, "invalid_request", "one version per name")
    assert app.tc.delete("/v1/tensors/present").status_code == 204


def test_unknown_route_is_404_and_wrong_method_405(app: App) -> None:
    assert_error(app.tc.get("/v2/anything"), 404, "no_such_route", "/v2/anything")
    assert_error(app.tc.get("/"), 404, "no_such_route")
    assert_error(app.tc.put("/v1/alloc"), 405, "method_not_allowed")


def test_conflicts_are_409(app: App) -> None:
    other = app.open_session()
    h = app.alloc("w", [4], sid=other).json()
    r = app.tc.post(
        "/v1/publish", json={"name": "w", "version": h["version"]}, headers=app.headers()
    )
    assert_error(r, 409, "conflict", "another session")
    assert_error(app.alloc("x", [4], sid="0" * 32), 409, "unknown_session", "open a new one")
    assert_error(app.tc.delete("/v1/sessions/" + "0" * 32), 409, "unknown_session")
    assert_error(app.tc.post("/v1/sessions/nope/heartbeat"), 409, "unknown_session")
    assert app.tc.delete(f"/v1/sessions/{other}").status_code == 204  # reclaims w's version
    check_accounting(app.broker)
    assert app.broker.bytes_in_use == 0


def test_out_of_memory_is_507(app: App) -> None:
    assert_error(app.alloc("big", [MAX_MEMORY + 1], "uint8"), 507, "out_of_memory", "--max-memory")
    held = [app.alloc(f"w{i}", [3 * MiB], "uint8") for i in range(2)]
    assert [r.status_code for r in held] == [200, 200]
    assert_error(app.alloc("w2", [3 * MiB], "uint8"), 507, "out_of_memory", "delete()")
    check_accounting(app.broker)
    r = app.tc.post(
        "/v1/many/alloc",
        headers=app.headers(),
        json={"names": ["b0", "b1"], "shapes": [[MiB], [3 * MiB]], "dtypes": ["uint8", "uint8"]},
    )
    assert_error(r, 507, "out_of_memory")
    assert "b0" not in app.broker.entries, "a batch that does not fit leaves nothing behind"
    r = app.tc.post(
        "/v1/many/alloc",
        headers=app.headers(),
        json={"names": ["b0", "b1"], "shapes": [[MiB], [3 * MiB]], "dtypes": ["uint8", "uint8"]},
    )
    assert_error(r, 507, "out_of_memory")
    assert "b0" not in app.broker.entries, "a batch that does not fit leaves nothing behind"
    check_accounting(app.broker)


def test_leases_are_released_only_by_their_session(app: App) -> None:
    app.put("w", b"\x07" * 4, "4")
    lease = app.tc.get("/v1/tensors/w", headers=app.headers()).json()["lease"]
    other = app.open_session()
    for headers in ({}, {SESSION: other}, {SESSION: "nope"}):
        r = app.tc.post("/v1/release", json={"leases": [lease]}, headers=headers)
        assert r.status_code == 200 and r.json() == {"released": 0}, (headers, r.text)
    assert lease in app.broker.leases
    r = app.tc.post("/v1/release", json={"leases": [lease, lease]}, headers=app.headers())
    assert r.json() == {"released": 1}
    assert app.broker.leases == {}


def test_shutting_down_is_503(app: App) -> None:
    app.put("w", b"\x01", "1")
    results: list[Any] = []
    waiter = threading.Thread(
        target=lambda: results.append(
            app.tc.get("/v1/tensors/never?timeout=60", headers=app.headers())
        )
    )
    waiter.start()
    wait_for(lambda: "never" in app.broker.waits, 10, what="the get to wait")
    app.on_loop(app.broker.begin_shutdown)
    waiter.join(10)
    assert not waiter.is_alive(), "a waiting get must wake when the broker shuts down"
    assert_error(results[0], 503, "broker_unavailable", "shutting down")
    assert_error(app.tc.post("/v1/sessions", json={"pid": os.getpid()}), 503, "broker_unavailable")
    assert_error(app.alloc("x", [1]), 503, "broker_unavailable")
    assert_error(app.tc.get("/v1/tensors/w", headers=app.headers()), 503, "broker_unavailable")
    assert_error(app.tc.delete("/v1/tensors/w"), 503, "broker_unavailable")
    assert app.tc.get("/healthz").json()["status"] == "shutting_down"


# -- the OpenAPI document -------------------------------------------------------


def router_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the route table that a handler serves."""
    found = {(r.method, r.template) for r in ROUTES if r.handler is not None}
    assert len(found) >= 15
    return found


def test_operation_ids_are_short_unique_and_stable(app: App) -> None:
    """A client generated from /openapi.json gets one function per route,
    named after the operation, not after the path and method."""
    doc = app.tc.get("/openapi.json").json()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    for op in ids:
        assert re.fullmatch(r"[a-z]+(_[a-z0-9]+)*", op), op
        assert "_v1_" not in op and not op.endswith(("_get", "_post", "_delete")), op
    assert {"get_tensor", "put_tensor", "alloc_many", "get_many"} <= set(ids)
    assert sorted(ids) == sorted(r.op for r in ROUTES if r.handler is not None)


def test_openapi_is_complete(app: App) -> None:
    r = app.tc.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == router_routes(), "every router's routes are served and documented"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            where = f"{method.upper()} {path}"
            assert op.get("summary"), f"{where} has no summary"
            assert op.get("tags"), f"{where} has no tag"
            ok = [s for s in op["responses"] if s.startswith("2")]
            assert len(ok) == 1, f"{where}: success responses {ok}"
            if ok[0] != "204":
                content = op["responses"][ok[0]].get("content", {})
                assert content, f"{where} documents no response body"
                for media in content.values():
                    schema = media.get("schema", {})
                    if "$ref" in schema:
                        assert schema["$ref"].rsplit("/", 1)[-1] in schemas
            errors = {s for s in op["responses"] if not s.startswith("2")}
            assert errors >= ERROR_STATUSES, f"{where} documents only errors {sorted(errors)}"
            for status in errors:
                ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorBody", f"{where} {status}: {ref}"
    # FastAPI's default 422 body ({"detail": [...]}) is not what the broker sends.
    assert "HTTPValidationError" not in schemas


# -- fuzzing --------------------------------------------------------------------

_JSON_LEAVES = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
)
any_json = st.recursive(
    _JSON_LEAVES,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=12,
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
NAMES = ["w", "x", "run/1/w", "a.b"]
names = (
    st.sampled_from(NAMES)
    | st.sampled_from(NAMES)
    | st.text(max_size=30)
    | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=600)
)
big_ints = st.sampled_from([0, 1, -1, 2**31, 2**32, 2**62, 2**63, 2**64, 10**30, -(2**63)])
dims = st.integers(0, 64) | big_ints
dtypes = st.sampled_from(sorted(DTYPES)) | st.text(max_size=12)
# Never a long or endless wait: the fuzz must not stall on a name nobody publishes.
timeouts = st.sampled_from([0, 0.0, 0.001, -1, -1e-9, "0", "soon", [], {}, False, math.nan])
query_timeouts = st.sampled_from(["0", "0.001", "-1", "nan", "NaN", "-inf", "", "soon", "1e-3x"])

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": names,
    "names": st.lists(names, max_size=4),
    "shape": st.lists(dims, max_size=4) | any_json,
    "dtype": dtypes,
    "device": st.sampled_from(["cpu", "cpu:0", "cuda:0", "", "CPU"]) | st.text(max_size=70),
    "ttl": (
        st.none() | st.floats(min_value=1e-3, max_value=1e308) | st.sampled_from([0, -1, math.inf])
    ),
    "version": st.integers(-1, 4) | big_ints,
    "leases": st.lists(st.integers(-1, 20) | big_ints, max_size=5),
    "pid": st.sampled_from([os.getpid(), 1, 0, -1, 2**62, 2**80]),
    "start_time": st.none() | big_ints,
    "label": st.none() | st.text(max_size=220),
    "timeout": timeouts,
}
PARAMS: dict[str, st.SearchStrategy[str]] = {
    "timeout": query_timeouts,
    "newer_than": st.sampled_from(["0", "1", "-1", "x", str(2**64)]),
    "dtype": dtypes.filter(lambda s: "\x00" not in s),
    "shape": st.sampled_from(
        ["", "1", "4", "2,2", "0", "-1", "x", ",", "1,,2", " 3 ", "1_0", "4294967296,4294967296"]
    ),
    "ttl": st.sampled_from(["0.001", "1", "0", "-1", "inf", "nan", "x"]),
}


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def body_for(doc: dict[str, Any], schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly near-valid objects of the schema (values mangled, fields dropped
    or added), sometimes any JSON at all."""
    schema = _resolve(doc, schema)
    props = schema.get("properties", {})
    required = set(schema.get("required", []))

    def field(key: str, sub: dict[str, Any]) -> st.SearchStrategy[Any]:
        sub = _resolve(doc, sub)
        if key == "timeout":
            return FIELDS[key]
        if key in FIELDS:
            good = FIELDS[key]
        elif sub.get("type") == "array" and "$ref" in sub.get("items", {}):
            good = st.lists(body_for(doc, sub["items"]), max_size=4)
        else:
            return any_json
        # mostly plausible values, so checks deep inside run
        return st.one_of(good, good, good, any_json)

    fields = {k: field(k, v) for k, v in props.items()}
    near = st.fixed_dictionaries(
        {k: s for k, s in fields.items() if k in required},
        optional={k: s for k, s in fields.items() if k not in required},
    )
    dropped = st.fixed_dictionaries({}, optional=fields)
    extra = st.tuples(
        near, st.dictionaries(st.text(max_size=8), _JSON_LEAVES, min_size=1, max_size=2)
    ).map(lambda t: {**t[1], **t[0]})
    # Any JSON at the top level, but never one that carries a "timeout".
    junk = any_json.filter(lambda x: not isinstance(x, dict) or "timeout" not in x)
    return st.one_of(near, near, near, dropped, extra, junk)


def request_for(doc: dict[str, Any], path: str, method: str) -> st.SearchStrategy[dict[str, Any]]:
    op = doc["paths"][path][method]
    parts: dict[str, st.SearchStrategy[Any]] = {"path": st.just(path), "method": st.just(method)}
    for p in op.get("parameters", []):
        if p["in"] == "path":
            values = st.sampled_from(["$session", "$other"]) if p["name"] == "session" else names
            parts["path:" + p["name"]] = values | header_text
        elif p["in"] == "query":
            parts["query:" + p["name"]] = st.none() | PARAMS.get(p["name"], header_text)
        elif p["in"] == "header" and p["name"] == SESSION:
            parts[p["name"]] = st.sampled_from(["$session", "$session", "$other", None, "", "nope"])
    # Any request may piggyback lease releases, documented or not.
    parts[RELEASE] = (
        st.none()
        | st.lists(st.integers(-1, 20) | big_ints, max_size=3).map(
            lambda xs: ",".join(map(str, xs))
        )
        | header_text
    )
    content = op.get("requestBody", {}).get("content", {})
    if "application/json" in content:
        parts["json"] = body_for(doc, content["application/json"]["schema"]) | st.binary(
            max_size=40
        )
    elif "application/octet-stream" in content:
        parts["bytes"] = st.binary(max_size=64) | st.integers(0, 64).map(bytes)
    return st.fixed_dictionaries(parts)


def send(app: App, other: str, req: dict[str, Any]) -> Any:
    ids = {"$session": app.sid, "$other": other}
    path = req["path"]
    for key, value in req.items():
        if key.startswith("path:"):
            path = path.replace("{" + key[5:] + "}", quote(ids.get(value, value), safe=""))
    params = {k[6:]: v for k, v in req.items() if k.startswith("query:") and v is not None}
    headers = {k: ids.get(v, v) for k, v in req.items() if k.startswith("x-") and v is not None}
    content: bytes | None = req.get("bytes")
    if "json" in req:
        body = req["json"]
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["content-type"] = "application/json"
    r = app.tc.request(req["method"].upper(), path, params=params, headers=headers, content=content)
    r.asked_path = unquote(path)  # what the route's template made (check_response)
    return r


def check_response(doc: dict[str, Any], req: dict[str, Any], r: Any) -> None:
    where = f"{req['method'].upper()} {req['path']}"
    assert r.status_code < 500 or r.status_code == 507, f"{where} -> {r.status_code}: {r.text}"
    responses = doc["paths"][req["path"]][req["method"]]["responses"]
    if getattr(r, "asked_path", r.request.url.path) != r.request.url.path:
        # The HTTP client rewrote the path (a "." parameter is a dot segment:
        # /v1/tensors/. is sent as /v1/tensors): the answer is another route's.
        return
    # An empty or odd path parameter can land on another route (or none): the
    # router's 404/405 and its trailing-slash redirect are fine there.
    routing = {307, 404, 405}
    assert str(r.status_code) in responses or r.status_code in routing, (
        f"{where} -> undocumented {r.status_code}: {r.text}"
    )
    if r.is_redirect:
        return
    if r.status_code >= 400:
        assert_error(r, r.status_code)
        return
    media = responses[str(r.status_code)].get("content", {}).get("application/json")
    if media is not None:
        # Every success body is what the OpenAPI document says it is.
        jsonschema.validate(r.json(), {**media["schema"], "components": doc["components"]})


def reset(app: App) -> None:
    """End every session and delete every name: the books must then read zero."""
    for sid in list(app.broker.sessions):
        assert app.tc.delete(f"/v1/sessions/{sid}").status_code == 204
    for name in list(app.broker.entries):
        assert app.tc.delete(f"/v1/tensors/{quote(name, safe='')}").status_code == 204
    st_ = app.tc.get("/v1/stat").json()
    counts = (st_["bytes_in_use"], st_["versions"], st_["leases"], st_["sessions"])
    assert counts == (0, 0, 0, 0), st_
    app.on_loop(check_accounting, app.broker)
    assert app.broker.pool.used == 0
    app.sid = app.open_session()


@pytest.fixture(scope="module")
def fuzz_app() -> Iterator[tuple[App, dict[str, Any]]]:
    # Module scope: hypothesis runs many examples per test; the pool is
    # reused and the books are zeroed between examples.
    prefix = f"{TEST_PREFIX}fuzz-{secrets.token_hex(4)}-"
    with TestClient(create_app(small_settings(prefix)), follow_redirects=False) as tc:
        app = App(tc, prefix)
        yield app, tc.get("/openapi.json").json()
    assert shm_entries(prefix) == []


def _operations() -> list[tuple[str, str]]:
    doc = create_app(Settings(token="")).openapi()
    return [(p, m) for p, ops in doc["paths"].items() for m in ops]


@contextlib.contextmanager
def told(what: str) -> Iterator[None]:
    """Print what fails in ``what`` to stderr, which pytest shows with the
    failure: when an error does not come back on hypothesis' replay, it
    reports only that the example drew differently (FlakyStrategyDefinition),
    and this is the one trace of the error itself."""
    try:
        yield
    except BaseException:
        print(f"fuzz: {what} raised:", file=sys.stderr)
        traceback.print_exc()
        raise


FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize(
    "path,method", [pytest.param(p, m, id=f"{m}-{p}") for p, m in _operations()]
)
@FUZZ
@given(data=st.data())
def test_fuzz_every_route(
    fuzz_app: tuple[App, dict[str, Any]], path: str, method: str, data: st.DataObject
) -> None:
    app, doc = fuzz_app
    try:
        with told("the example"):
            other = app.open_session()
            # Something to find: a published tensor, a leased one, and one being written.
            assert app.put("w", b"\x01\x02\x03\x04", "4").status_code == 200
            assert app.tc.get("/v1/tensors/w", headers=app.headers()).status_code == 200
            assert app.alloc("x", [3], "uint8", sid=other).status_code == 200
            for _ in range(data.draw(st.integers(1, 3), label="repeat")):
                req = data.draw(request_for(doc, path, method), label="request")
                check_response(doc, req, send(app, other, req))
                app.on_loop(check_accounting, app.broker)
            assert app.tc.get("/healthz").json()["status"] == "ok"
    finally:
        with told("the reset after it"):
            reset(app)


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_fuzz_request_sequences(fuzz_app: tuple[App, dict[str, Any]], data: st.DataObject) -> None:
    """Random requests to random routes, in sequence: they interact through the broker."""
    app, doc = fuzz_app
    other = app.open_session()
    ops = [(p, m) for p, ops in doc["paths"].items() for m in ops]
    try:
        for _ in range(data.draw(st.integers(1, 12), label="length")):
            path, method = data.draw(st.sampled_from(ops), label="route")
            req = data.draw(request_for(doc, path, method), label="request")
            check_response(doc, req, send(app, other, req))
        app.on_loop(check_accounting, app.broker)
    finally:
        reset(app)
    # Still serving: a normal exchange works after whatever came before.
    data_ = bytes(range(16))
    assert app.put("after", data_, "16").status_code == 200
    h = app.tc.get("/v1/tensors/after", headers=app.headers()).json()
    assert h["nbytes"] == 16 and h["state"] == "ready"
    reset(app)


def test_inline_bytes_roundtrip(app: App) -> None:
    """The fuzz's one positive control: what a put stores is what the handle points at."""
    from tensordepot.shm import PosixMapping, byte_view

    payload = secrets.token_bytes(1000)
    h = app.put("blob", payload, "1000").json()
    got = app.tc.get("/v1/tensors/blob", headers=app.headers()).json()
    assert (got["segment"], got["offset"], got["version"]) == (h["segment"], h["offset"], 1)
    m = PosixMapping(got["segment"], writable=False)
    assert bytes(byte_view(m, got["offset"], 1000, writable=False)) == payload
    assert "data" not in got, "handles carry metadata, never the bytes"


def test_an_app_with_flight_settings_binds_flight_with_the_brokers_policy(
    make_app: Callable[..., App],
) -> None:
    """Without the CLI, the lifespan binds --flight itself, on the broker's own
    tokens and scopes (the CLI binds it before the app when it serves)."""
    fl = pytest.importorskip("pyarrow.flight")
    app = make_app(flight="grpc://127.0.0.1:0")
    collectors = app.tc.app.state.metrics.collectors
    [flight] = [c for c in collectors if type(c).__name__ == "FlightService"]
    assert app.put("w", bytes(range(8)), "8").status_code == 200
    with fl.connect(flight.url) as client:
        assert [f.descriptor.path for f in client.list_flights()] == [[b"w"]]
