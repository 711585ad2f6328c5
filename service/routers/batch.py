"""Batches: a whole state dict in one round trip per step."""

from __future__ import annotations

import math

from fastapi import APIRouter, Request

from ..._errors import DepotError
from ..._wire import BatchAlloc, BatchGet, BatchPublish, HandleList
from .._auth import principal_of, require_names
from .._deps import SessionHeader, broker_of

router = APIRouter(prefix="/v1/batch", tags=["batch"])


@router.post("/alloc", response_model=HandleList, summary="Allocate many versions at once")
async def alloc_many(req: BatchAlloc, request: Request, session: SessionHeader = None) -> HandleList:
    require_names(principal_of(request), (i.name for i in req.items))  # before anything is allocated
    broker = broker_of(request)
    done = []
    try:
        for item in req.items:
            done.append(broker.alloc(session, item))
    except DepotError:
        # All or nothing: a batch that does not fit leaves no half-written state dict.
        for v in done:
            broker.abandon(v)
        raise
    return HandleList(items=[broker.handle(v) for v in done])


@router.post("/publish", response_model=HandleList, summary="Publish many versions at once")
async def publish_many(req: BatchPublish, request: Request, session: SessionHeader = None) -> HandleList:
    require_names(principal_of(request), (i.name for i in req.items))
    broker = broker_of(request)
    return HandleList(items=[broker.handle(broker.publish(session, i.name, i.version)) for i in req.items])


@router.post("/get", response_model=HandleList, summary="Lease many tensors at once")
async def get_many(req: BatchGet, request: Request, session: SessionHeader = None) -> HandleList:
    require_names(principal_of(request), req.names)
    broker = broker_of(request)
    timeout = None if req.timeout is None or math.isinf(req.timeout) else req.timeout
    got: list[tuple[object, int]] = []
    try:
        for name in req.names:
            got.append(await broker.get(session, name, timeout))
    except DepotError:
        broker.release(session, [lease for _, lease in got])
        raise
    return HandleList(items=[broker.handle(v, lease) for v, lease in got])  # type: ignore[arg-type]
