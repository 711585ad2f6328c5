"""The one route table: every route of the broker, in one list.

It feeds the doors' dispatch (``match``), the scopes the gate checks, the
metric labels (``Route.template``), SECURITY.md's scope table and the
OpenAPI document (``openapi_routes``).  A route is declared once, beside
its handler, in ``service/_http/routers/``.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import Body
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ..._wire import ErrorBody
from ._handler import JSON, Route
from .routers import cuda, many, sessions, system, tensors

ROUTES: tuple[Route, ...] = (
    *system.ROUTES,
    *sessions.ROUTES,
    *tensors.ROUTES,
    *many.ROUTES,
    *cuda.ROUTES,
)


class _Pattern:
    """A template with one parameter, matched without a regex: its literal
    head and tail.  ``{x}`` spans one path segment (no '/'), ``{x:path}``
    the rest, slashes included (maybe empty).  Every other character,
    control characters included, is the parameter's: what it may be is the
    gate's check (a tensor name: ``check_name``), never the router's."""

    __slots__ = ("head", "name", "route", "spans", "tail")

    def __init__(self, r: Route) -> None:
        self.route = r
        self.head, _, rest = r.path.partition("{")
        param, _, self.tail = rest.partition("}")
        assert "{" not in self.tail, f"{r.path}: one parameter per route"
        self.name, _, kind = param.partition(":")
        self.spans = kind == "path"

    def match(self, path: str) -> dict[str, str] | None:
        head, tail = self.head, self.tail
        if (
            not path.startswith(head)
            or not path.endswith(tail)
            or len(path) < len(head) + len(tail)
        ):
            return None
        value = path[len(head) : len(path) - len(tail)]
        if not self.spans and (not value or "/" in value):
            return None
        return {self.name: value}


_EXACT: dict[tuple[str, str], Route] = {(r.method, r.path): r for r in ROUTES if "{" not in r.path}
_PATTERNS = [_Pattern(r) for r in ROUTES if "{" in r.path]
_PATHS = frozenset(r.path for r in ROUTES if "{" not in r.path)
_BY_METHOD: dict[str, list[_Pattern]] = {}  # in the table's order: a GET tries one pattern
for _p in _PATTERNS:
    _BY_METHOD.setdefault(_p.route.method, []).append(_p)


def _find(method: str, path: str) -> tuple[Route | None, dict[str, str]]:
    r = _EXACT.get((method, path))
    if r is not None:
        return r, {}
    for p in _BY_METHOD.get(method, ()):
        params = p.match(path)
        if params is not None:
            return p.route, params
    return None, {}


def match(method: str, path: str) -> tuple[Route | None, dict[str, str], bool]:
    """(the route, its path parameters, whether the path exists for another
    method) for a request; (None, {}, False) for a path no route serves.
    HEAD is GET without the body, on the GET routes that change nothing."""
    head = method == "HEAD"
    r, params = _find("GET" if head else method, path)
    if r is not None and (r.head or not head):
        return r, params, False
    other = r is not None or path in _PATHS or any(p.match(path) is not None for p in _PATTERNS)
    return None, {}, other


# -- the OpenAPI document --------------------------------------------------------------

# Every route may answer with these; the body is always ErrorBody.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in (
        (400, "bad input"),
        (401, "no or unknown credentials (a bearer token)"),
        (
            403,
            (
                "not allowed: a missing scope, a name outside the token's "
                "prefix, a unix peer whose uid is not admitted, or another "
                "client's session"
            ),
        ),
        (404, "unknown name or route"),
        (409, "conflict with the tensor's state"),
        (413, "request body too large"),
        (422, "malformed request"),
        (429, "a per-client limit (sessions)"),
        (503, "the broker is shutting down"),
        (507, "out of memory (--max-memory, or a per-session/per-token quota)"),
    )
}


def _documented(r: Route) -> Any:
    """A function FastAPI reads the route's body from (never called: the doors
    serve every route through its handler)."""

    async def endpoint(**_: Any) -> None:  # pragma: no cover - documentation only
        raise AssertionError("the gate serves this route")

    params = []
    if r.body is not None and not r.framed:  # a framed body's docs say what it is
        model: type[BaseModel] = r.body
        params.append(
            inspect.Parameter(
                "body", inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[model, Body()]
            )
        )
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__doc__ = r.handler.__doc__ if r.handler is not None else None
    return endpoint


def openapi_routes() -> list[APIRoute]:
    """The table as FastAPI routes, for ``fastapi.openapi.utils.get_openapi``
    alone: they are never added to the app's router."""
    out = []
    for r in ROUTES:
        if r.handler is None:
            continue
        out.append(
            APIRoute(
                r.path,
                _documented(r),
                methods=[r.method],
                operation_id=r.op,
                summary=r.summary,
                tags=[r.tag] if r.tag else None,
                response_model=r.answers,
                status_code=r.status,
                responses=dict(ERROR_RESPONSES),
                openapi_extra=r.docs or None,
                response_class=JSONResponse if r.media == JSON else Response,
            )
        )
    return out
