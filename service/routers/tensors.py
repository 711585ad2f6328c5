"""Tensors: allocate, publish, put, get (long poll), release, delete, list."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ValidationError

from ..._errors import DepotError, InvalidRequest
from ..._wire import (
    INLINE_MAX,
    AllocRequest,
    Handle,
    LinkRequest,
    PublishRequest,
    ReleaseRequest,
    TensorList,
)
from .._auth import principal_of, require_name
from .._deps import SESSION_HEADER, SessionHeader, broker_of, error_response

router = APIRouter(prefix="/v1", tags=["tensors"])


def _json(handle: Handle) -> Response:
    # Serialised here: FastAPI would validate the model against response_model
    # again on the way out; the model is already valid by construction.
    return Response(handle.model_dump_json(), media_type="application/json")


class Released(BaseModel):
    released: int


# The hot read path parses its own parameters: FastAPI's per-parameter
# machinery costs more than the lease itself.  They are documented here.
_GET_PARAMS = {"parameters": [
    {"name": "timeout", "in": "query", "required": False,
     "schema": {"type": "number", "minimum": 0, "default": 0},
     "description": "seconds to wait for a publish; 0: none; inf: forever"},
    {"name": "newer_than", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 0, "default": 0},
     "description": "only a version newer than this"},
    {"name": SESSION_HEADER, "in": "header", "required": True, "schema": {"type": "string"},
     "description": "the id from POST /v1/sessions"},
]}


def _bad_query(message: str) -> InvalidRequest:
    exc = InvalidRequest(f"invalid request: {message}")
    exc.status = 422  # as FastAPI answers for the query parameters it validates itself
    return exc


async def get_tensor(request: Request) -> Response:
    """GET /v1/tensors/{name}.  ``HotPaths`` calls this directly, ahead of
    FastAPI's routing and parameter machinery, which cost more than the lease
    itself; the declaration below documents it and serves it otherwise."""
    q = request.query_params
    try:
        timeout = float(q.get("timeout", 0.0))
        newer_than = int(q.get("newer_than", 0))
    except ValueError:
        raise _bad_query("timeout must be a number of seconds (or inf), newer_than an integer") from None
    if not timeout >= 0 or newer_than < 0:  # `not >=` also catches NaN
        raise _bad_query("timeout and newer_than must be >= 0")
    broker = broker_of(request)
    v, lease = await broker.get(request.headers.get(SESSION_HEADER), request.path_params["name"],
                                None if math.isinf(timeout) else timeout, newer_than)
    return _json(broker.handle(v, lease))


@router.get("/tensors/{name:path}", response_model=Handle, openapi_extra=_GET_PARAMS,
            summary="Lease the newest published version, waiting up to `timeout` seconds")
async def get_tensor_documented(name: str, request: Request) -> Response:
    return await get_tensor(request)


@router.post("/alloc", response_model=Handle,
             summary="Allocate a new version (state 'writing') to fill in place")
async def alloc(req: AllocRequest, request: Request, session: SessionHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)
    return _json(broker.handle(broker.alloc(session, req)))


@router.post("/publish", response_model=Handle, summary="Make a written version visible")
async def publish(req: PublishRequest, request: Request, session: SessionHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)
    return _json(broker.handle(broker.publish(session, req.name, req.version)))


@router.post("/abort", status_code=204,
             summary="Give back an allocated version that will not be published")
async def abort(req: PublishRequest, request: Request, session: SessionHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker_of(request).abort(session, req.name, req.version)
    return Response(status_code=204)


_OCTETS = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary",
               "description": f"the tensor's C-ordered bytes, at most {INLINE_MAX}"}}}}}


async def put(request: Request) -> Response:
    """POST /v1/put/{name}, served like ``get_tensor``."""
    name = request.path_params["name"]
    q = request.query_params
    length = request.headers.get("content-length", "")
    if not length.isdigit() or int(length) > INLINE_MAX:
        raise InvalidRequest(f"put carries at most {INLINE_MAX} bytes with a Content-Length; "
                             f"larger tensors go through /v1/alloc and /v1/publish")
    if "dtype" not in q:
        raise _bad_query("put needs ?dtype=")
    try:
        ttl = float(q["ttl"]) if q.get("ttl") else None
    except ValueError:
        ttl = -1.0
    if ttl is not None and not ttl > 0:
        raise _bad_query("ttl must be a number of seconds > 0")
    try:
        shape = q.get("shape", "")
        dims = [int(d) for d in shape.split(",")] if shape else []
        req = AllocRequest(name=name, shape=dims, dtype=q["dtype"], ttl=ttl)
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(f"invalid put of {name!r}: {exc}".splitlines()[0]) from None
    broker = broker_of(request)
    body = await request.body()
    return _json(broker.handle(broker.put_inline(request.headers.get(SESSION_HEADER), req, body)))


@router.post("/put/{name:path}", response_model=Handle, openapi_extra=_OCTETS,
             summary="Allocate, fill and publish a small tensor in one round trip")
async def put_documented(
    name: str,
    request: Request,
    dtype: Annotated[str, Query(max_length=40, examples=["float32"])],
    shape: Annotated[str, Query(max_length=400, description="comma-separated dims; empty for a scalar")] = "",
    ttl: Annotated[float | None, Query(gt=0, description="delete this many seconds after publish")] = None,
    session: SessionHeader = None,
) -> Response:
    return await put(request)


@router.post("/link", response_model=Handle,
             summary="Publish a leased version's bytes under another name, without a copy")
async def link(req: LinkRequest, request: Request, session: SessionHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)
    return _json(broker.handle(broker.link(session, req.name, req.lease, req.ttl)))


@router.post("/release", response_model=Released, summary="Release leases taken by get")
async def release(req: ReleaseRequest, request: Request, session: SessionHeader = None) -> Released:
    return Released(released=broker_of(request).release(session, req.leases))


@router.get("/tensors", response_model=TensorList, summary="List tensors")
async def list_tensors(request: Request) -> TensorList:
    principal = principal_of(request)  # a prefix-limited token sees only its own names
    return TensorList(items=[i for i in broker_of(request).list() if principal.may_use(i.name)])


@router.delete("/tensors/{name:path}", status_code=204,
               summary="Delete a name now; its memory is freed when the last reader releases it")
async def delete_tensor(name: str, request: Request) -> Response:
    broker_of(request).delete(name)
    return Response(status_code=204)


class HotPaths:
    """ASGI middleware that serves the two hottest requests, GET
    /v1/tensors/{name} and POST /v1/put/{name}, before FastAPI routes them.

    Routing, dependency solving and parameter validation cost FastAPI more
    than twice a bare endpoint's whole request; the control plane's speed is
    the product (README, Benchmarks: B5).  The handlers are the same functions
    the documented routes call, and errors get the same body as everywhere."""

    _GET = "/v1/tensors/"
    _PUT = "/v1/put/"

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            handler = None
            if method == "GET" and path.startswith(self._GET) and len(path) > len(self._GET):
                handler, name = get_tensor, path[len(self._GET):]
            elif method == "POST" and path.startswith(self._PUT) and len(path) > len(self._PUT):
                handler, name = put, path[len(self._PUT):]
            if handler is not None:
                scope["path_params"] = {"name": name}
                try:
                    response = await handler(Request(scope, receive))
                except DepotError as exc:
                    response = error_response(exc.status, exc.code, str(exc))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
