"""Tensors: allocate, publish, put, get (long poll), release, delete, list.

The two hottest requests, ``GET /v1/tensors/{name}`` and ``POST
/v1/put/{name}``, are served by plain Starlette routes placed ahead of
FastAPI's (``HOT_ROUTES``, inserted by ``app.create_app``): FastAPI's
routing, dependency solving and parameter validation cost more than twice a
bare endpoint's whole request.  They parse and check their own parameters,
exactly as their FastAPI declarations below document them (which serve the
OpenAPI document), and their errors go through the app's exception handlers
like every other route's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.routing import Route

from ..._errors import InvalidRequest
from ..._proto import MAX_WAIT, REQUEST_HEADER, SESSION_HEADER
from ..._wire import (
    INLINE_MAX,
    MAX_NDIM,
    NAME_PATTERN,
    AllocRequest,
    Handle,
    LinkRequest,
    PublishRequest,
    ReleaseRequest,
    TensorList,
)
from .._auth import principal_of, require_name
from .._deps import (
    RequestHeader,
    SessionHeader,
    broker_of,
    caller,
    hangup,
    json_response,
    once,
)

router = APIRouter(prefix="/v1", tags=["tensors"])
_NAME = re.compile(NAME_PATTERN)


def _json(handle: Handle) -> Response:
    # Serialised here: FastAPI would validate the model against response_model
    # again on the way out; the model is already valid by construction.
    return json_response(handle.model_dump_json())


class Released(BaseModel):
    released: int


_SESSION_PARAM = {"name": SESSION_HEADER, "in": "header", "required": True,
                  "schema": {"type": "string"}, "description": "the id from POST /v1/sessions"}
_NAME_PARAM = {"name": "name", "in": "path", "required": True,
               "schema": {"type": "string", "pattern": NAME_PATTERN},
               "description": "printable ASCII without spaces, 1 to 512 characters"}

# The hot routes parse their own parameters; this is what they enforce.
_GET_PARAMS = {"parameters": [
    _NAME_PARAM,
    {"name": "timeout", "in": "query", "required": False,
     "schema": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "enum": ["inf"]}],
                "default": 0},
     "description": f"seconds to wait for a publish; 0: none; inf (or over {MAX_WAIT:g}): forever"},
    {"name": "newer_than", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 0, "default": 0},
     "description": "only a version newer than this"},
    _SESSION_PARAM,
]}


def _bad_query(message: str) -> InvalidRequest:
    exc = InvalidRequest(f"invalid request: {message}")
    exc.status = 422  # as FastAPI answers for the query parameters it validates itself
    return exc


def tensor_name(name: str) -> str:
    """The ``{name}`` of a hot route's path, checked."""
    if not _NAME.match(name):
        shown = name if len(name) <= 60 else name[:60] + f"... ({len(name)} characters)"
        raise _bad_query(f"tensor name {shown!r}: use 1 to 512 printable ASCII characters, no "
                         "spaces")
    return name


def _name(request: Request) -> str:
    return tensor_name(request.path_params["name"])


def get_params(q: Mapping[str, str]) -> tuple[float | None, int]:
    """(seconds to wait or None for forever, newer_than) of a get's query."""
    try:
        timeout = float(q.get("timeout", 0.0))
        newer_than = int(q.get("newer_than", 0))
    except ValueError:
        raise _bad_query("timeout must be a number of seconds (or inf), newer_than an "
                         "integer") from None
    if not timeout >= 0 or newer_than < 0:  # `not >=` also catches NaN
        raise _bad_query("timeout and newer_than must be >= 0")
    return (None if timeout > MAX_WAIT else timeout), newer_than


async def get_tensor(request: Request) -> Response:
    """GET /v1/tensors/{name} (a hot route; see the module docstring)."""
    name = _name(request)
    wait, newer_than = get_params(request.query_params)
    broker = broker_of(request)
    rid = request.headers.get(REQUEST_HEADER)

    async def run() -> Response:
        ready = broker._ready(name, newer_than) is not None
        v, lease = await broker.get(request.headers.get(SESSION_HEADER), caller(request), name,
                                    wait, newer_than, request=rid,
                                    gone=None if ready or wait == 0 else lambda: hangup(request))
        return _json(broker.handle(v, lease))

    return await once(request, run)


async def put(request: Request) -> Response:
    """POST /v1/put/{name} (a hot route; see the module docstring)."""
    req = put_params(_name(request), request.query_params,
                     request.headers.get("content-length", ""))
    broker = broker_of(request)

    async def run() -> Response:
        body = await request.body()
        v = await broker.put_inline(request.headers.get(SESSION_HEADER), caller(request), req, body)
        return _json(broker.handle(v))

    return await once(request, run)


def put_params(name: str, q: Mapping[str, str], length: str) -> AllocRequest:
    """What an inline put's query and Content-Length ask for, checked."""
    if not length.isdigit() or int(length) > INLINE_MAX:
        raise InvalidRequest(f"put carries at most {INLINE_MAX} bytes with a Content-Length; "
                             f"larger tensors go through /v1/alloc and /v1/publish")
    if "dtype" not in q:
        raise _bad_query("put needs ?dtype=")
    try:
        ttl = float(q["ttl"]) if q.get("ttl") else None
    except ValueError:
        ttl = -1.0
    if ttl is not None and not (0 < ttl < math.inf):
        raise _bad_query("ttl must be a finite number of seconds > 0")
    shape, dtype = q.get("shape", ""), q["dtype"]
    if len(shape) > 400:
        raise _bad_query(f"shape has {len(shape)} characters; at most 400 ({MAX_NDIM} dimensions)")
    try:
        dims = [int(d) for d in shape.split(",")] if shape else []
    except ValueError as exc:
        raise InvalidRequest(f"invalid put of {name!r}: {exc}") from None
    if len(dims) > MAX_NDIM or min(dims, default=0) < 0 or len(dtype) > 40:
        try:  # AllocRequest's own checks say what is wrong, as on every other route
            AllocRequest(name=name, shape=dims, dtype=dtype, ttl=ttl)
        except ValidationError as exc:
            raise InvalidRequest(f"invalid put of {name!r}: {exc}".splitlines()[0]) from None
    # The name, dims, dtype and ttl are checked above: AllocRequest's constraints all hold.
    return AllocRequest.model_construct(name=name, shape=dims, dtype=dtype, ttl=ttl)


HOT_ROUTES = [
    Route("/v1/tensors/{name:path}", get_tensor, methods=["GET"]),
    Route("/v1/put/{name:path}", put, methods=["POST"]),
]


@router.get("/tensors/{name:path}", response_model=Handle, openapi_extra=_GET_PARAMS,
            summary="Lease the newest published version, waiting up to `timeout` seconds")
async def get_tensor_documented(request: Request) -> Response:
    return await get_tensor(request)


@router.post("/alloc", response_model=Handle,
             summary="Allocate a new version (state 'writing') to fill in place")
async def alloc(req: AllocRequest, request: Request, session: SessionHeader = None,
                request_id: RequestHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)

    async def run() -> Response:
        v, hold = await broker.alloc(session, caller(request), req, request=request_id)
        return _json(broker.handle(v, hold))

    return await once(request, run)


@router.post("/publish", response_model=Handle, summary="Make a written version visible")
async def publish(req: PublishRequest, request: Request, session: SessionHeader = None,
                  request_id: RequestHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)

    async def run() -> Response:
        return _json(broker.handle(broker.publish(session, caller(request), req.name, req.version)))

    return await once(request, run)


@router.post("/abort", status_code=204,
             summary="Give back an allocated version that will not be published")
async def abort(req: PublishRequest, request: Request, session: SessionHeader = None,
                request_id: RequestHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)

    async def run() -> Response:
        broker.abort(session, caller(request), req.name, req.version)
        return Response(status_code=204)

    return await once(request, run)


_OCTETS = {
    "parameters": [_NAME_PARAM, _SESSION_PARAM],
    "requestBody": {"required": True, "content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary",
                   "description": f"the tensor's C-ordered bytes, at most {INLINE_MAX}"}}}},
}


@router.post("/put/{name:path}", response_model=Handle, openapi_extra=_OCTETS,
             summary="Allocate, fill and publish a small tensor in one round trip")
async def put_documented(
    request: Request,
    dtype: Annotated[str, Query(max_length=40, examples=["float32"])],
    shape: Annotated[str, Query(max_length=400,
                                description="comma-separated dims; empty for a scalar")] = "",
    ttl: Annotated[float | None,
                   Query(gt=0, description="delete this many seconds after publish")] = None,
) -> Response:
    return await put(request)


@router.post("/link", response_model=Handle,
             summary="Publish a leased version's bytes under another name, without a copy")
async def link(req: LinkRequest, request: Request, session: SessionHeader = None,
               request_id: RequestHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)

    async def run() -> Response:
        return _json(broker.handle(broker.link(session, caller(request), req.name, req.lease,
                                               req.ttl)))

    return await once(request, run)


@router.post("/release", response_model=Released,
             summary="Release leases, and cancel requests whose answers were never read")
async def release(req: ReleaseRequest, request: Request, session: SessionHeader = None) -> Released:
    broker = broker_of(request)
    n = broker.release(session, caller(request), req.leases, req.requests)
    n += broker.release_stale(caller(request), req.stale)
    return Released(released=n)


@router.get("/tensors", response_model=TensorList, summary="List tensors")
async def list_tensors(request: Request) -> TensorList:
    principal = principal_of(request)  # a prefix-limited token sees only its own names
    return TensorList(items=[i for i in broker_of(request).list() if principal.may_use(i.name)])


@router.delete("/tensors/{name:path}", status_code=204,
               summary="Delete a name now; its memory is freed when the last reader releases it")
async def delete_tensor(name: str, request: Request) -> Response:
    broker_of(request).delete(name)
    return Response(status_code=204)
