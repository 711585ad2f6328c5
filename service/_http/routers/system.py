"""Health, accounting and Prometheus metrics, and the API documents."""

from __future__ import annotations

from typing import Any

from ...._version import __version__
from ...._wire import Health, HolderList, Stat
from ..._auth import ADMIN, READ
from ..._metrics import CONTENT_TYPE
from .._handler import Call, Reply, Route, route, routes_of

TAG = "system"


@route(
    "GET",
    "/healthz",
    None,
    "healthz",
    tag=TAG,
    answers=Health,
    note="liveness for health checks; says nothing else",
    summary="Liveness",
)
def healthz(call: Call[Any]) -> Reply:
    status = "shutting_down" if call.broker.closing else "ok"
    return 200, Health(status=status, version=__version__).model_dump_json().encode()


@route(
    "GET",
    "/v1/stat",
    READ,
    "stat",
    tag=TAG,
    answers=Stat,
    note="totals only",
    summary="Memory and lifetime accounting",
)
def stat(call: Call[Any]) -> Reply:
    return 200, call.broker.stat().model_dump_json().encode()


@route(
    "GET",
    "/v1/who",
    READ,
    "who",
    tag=TAG,
    answers=HolderList,
    note="the caller's own sessions (admin: every session), and only names it may use",
    summary="Which process holds leases on which names and versions",
)
def who(call: Call[Any]) -> Reply:
    p = call.principal
    items = call.broker.who(None if p.has(ADMIN) else call.who.identity, p.may_use)
    return 200, HolderList(items=items).model_dump_json().encode()


@route(
    "GET",
    "/metrics",
    READ,
    "metrics",
    tag=TAG,
    media=CONTENT_TYPE,
    note="totals only: no names, no sessions",
    summary="Prometheus metrics",
    docs={"responses": {"200": {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}}},
)
def metrics(call: Call[Any]) -> Reply:
    text: bytes = call.state.metrics.render()  # the broker, Flight and the peers: collectors
    return 200, text


# FastAPI serves the API documents itself, behind the same gate.
DOCUMENTS = [
    Route("GET", path, READ, op, None, tag=TAG)
    for path, op in (
        ("/openapi.json", "openapi"),
        ("/docs", "docs"),
        ("/docs/oauth2-redirect", "docs_oauth2_redirect"),
        ("/redoc", "redoc"),
    )
]

ROUTES = [*routes_of(healthz, stat, who, metrics), *DOCUMENTS]
