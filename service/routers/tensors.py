"""Tensors: allocate, publish, put, get (long poll), release, delete, list."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ValidationError

from ..._errors import InvalidRequest
from ..._wire import (
    INLINE_MAX,
    AllocRequest,
    Handle,
    LinkRequest,
    PublishRequest,
    ReleaseRequest,
    TensorList,
)
from .._deps import BrokerDep, SessionDep

router = APIRouter(prefix="/v1", tags=["tensors"])


class Released(BaseModel):
    released: int


@router.post("/alloc", response_model=Handle,
             summary="Allocate a new version (state 'writing') to fill in place")
async def alloc(req: AllocRequest, broker: BrokerDep, session: SessionDep) -> Handle:
    v = broker.alloc(session, req)
    return broker.handle(v)


@router.post("/publish", response_model=Handle, summary="Make a written version visible")
async def publish(req: PublishRequest, broker: BrokerDep, session: SessionDep) -> Handle:
    return broker.handle(broker.publish(session, req.name, req.version))


@router.post("/abort", status_code=204,
             summary="Give back an allocated version that will not be published")
async def abort(req: PublishRequest, broker: BrokerDep, session: SessionDep) -> Response:
    broker.abort(session, req.name, req.version)
    return Response(status_code=204)


_OCTETS = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary",
               "description": f"the tensor's C-ordered bytes, at most {INLINE_MAX}"}}}}}


@router.post("/put/{name:path}", response_model=Handle, openapi_extra=_OCTETS,
             summary="Allocate, fill and publish a small tensor in one round trip")
async def put(
    name: str,
    request: Request,
    broker: BrokerDep,
    session: SessionDep,
    dtype: Annotated[str, Query(max_length=40, examples=["float32"])],
    shape: Annotated[str, Query(max_length=400, description="comma-separated dims; empty for a scalar")] = "",
    ttl: Annotated[float | None, Query(gt=0, description="delete this many seconds after publish")] = None,
) -> Handle:
    length = request.headers.get("content-length", "")
    if not length.isdigit() or int(length) > INLINE_MAX:
        raise InvalidRequest(f"put carries at most {INLINE_MAX} bytes with a Content-Length; "
                             f"larger tensors go through /v1/alloc and /v1/publish")
    try:
        dims = [int(d) for d in shape.split(",")] if shape else []
        req = AllocRequest(name=name, shape=dims, dtype=dtype, ttl=ttl)
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(f"invalid put of {name!r}: {exc}".splitlines()[0]) from None
    return broker.handle(broker.put_inline(session, req, await request.body()))


@router.post("/link", response_model=Handle,
             summary="Publish a leased version's bytes under another name, without a copy")
async def link(req: LinkRequest, broker: BrokerDep, session: SessionDep) -> Handle:
    return broker.handle(broker.link(session, req.name, req.lease, req.ttl))


@router.post("/release", response_model=Released, summary="Release leases taken by get")
async def release(req: ReleaseRequest, broker: BrokerDep, session: SessionDep) -> Released:
    return Released(released=broker.release(session, req.leases))


@router.get("/tensors", response_model=TensorList, summary="List tensors")
async def list_tensors(broker: BrokerDep) -> TensorList:
    return TensorList(items=broker.list())


@router.get("/tensors/{name:path}", response_model=Handle,
            summary="Lease the newest published version, waiting up to `timeout` seconds")
async def get_tensor(
    name: str,
    broker: BrokerDep,
    session: SessionDep,
    timeout: Annotated[float, Query(ge=0, description="seconds to wait; 0: none; inf: forever")] = 0.0,
    newer_than: Annotated[int, Query(ge=0, description="only a version newer than this")] = 0,
) -> Handle:
    v, lease = await broker.get(session, name, None if math.isinf(timeout) else timeout, newer_than)
    return broker.handle(v, lease)


@router.delete("/tensors/{name:path}", status_code=204,
               summary="Delete a name now; its memory is freed when the last reader releases it")
async def delete_tensor(name: str, broker: BrokerDep) -> Response:
    broker.delete(name)
    return Response(status_code=204)
