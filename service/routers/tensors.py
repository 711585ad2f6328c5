"""Tensors: allocate, publish, put, get (long poll), release, delete, list."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel

from ..._wire import AllocRequest, Handle, PublishRequest, PutRequest, ReleaseRequest, TensorList
from .._deps import BrokerDep, SessionHeader

router = APIRouter(prefix="/v1", tags=["tensors"])


class Released(BaseModel):
    released: int


@router.post("/alloc", response_model=Handle,
             summary="Allocate a new version (state 'writing') to fill in place")
async def alloc(req: AllocRequest, broker: BrokerDep, session: SessionHeader = None) -> Handle:
    v = broker.alloc(session, req)
    return broker.handle(v)


@router.post("/publish", response_model=Handle, summary="Make a written version visible")
async def publish(req: PublishRequest, broker: BrokerDep, session: SessionHeader = None) -> Handle:
    return broker.handle(broker.publish(session, req.name, req.version))


@router.post("/abort", status_code=204,
             summary="Give back an allocated version that will not be published")
async def abort(req: PublishRequest, broker: BrokerDep, session: SessionHeader = None) -> Response:
    broker.abort(session, req.name, req.version)
    return Response(status_code=204)


@router.post("/put", response_model=Handle,
             summary="Allocate, fill and publish a small tensor in one round trip")
async def put(req: PutRequest, broker: BrokerDep, session: SessionHeader = None) -> Handle:
    return broker.handle(broker.put_inline(session, req))


@router.post("/release", response_model=Released, summary="Release leases taken by get")
async def release(req: ReleaseRequest, broker: BrokerDep, session: SessionHeader = None) -> Released:
    return Released(released=broker.release(session, req.leases))


@router.get("/tensors", response_model=TensorList, summary="List tensors")
async def list_tensors(broker: BrokerDep) -> TensorList:
    return TensorList(items=broker.list())


@router.get("/tensors/{name:path}", response_model=Handle,
            summary="Lease the newest published version, waiting up to `timeout` seconds")
async def get_tensor(
    name: str,
    broker: BrokerDep,
    session: SessionHeader = None,
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
