"""Batches as columns: a state dict in one round trip per step, cheap per
tensor (service/_many.py).  The broker's fast lane serves the same routes
(service/_lane.py); these declarations serve ASGI clients and the OpenAPI
document."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._wire import BatchGet, HandleColumns, ManyAlloc, ManyPublish
from .. import _many
from .._auth import principal_of, require_names
from .._deps import RequestHeader, SessionHeader, broker_of, caller, hangup, json_response, once

router = APIRouter(prefix="/v1/many", tags=["batch"])


@router.post("/alloc", response_model=HandleColumns,
             summary="Allocate a version of each tensor (all of them, or none)")
async def alloc_many(req: ManyAlloc, request: Request, session: SessionHeader = None,
                     request_id: RequestHeader = None) -> Response:
    require_names(principal_of(request), req.names)  # before anything is allocated
    broker = broker_of(request)

    async def run() -> Response:
        return json_response(await _many.alloc(broker, session, caller(request), req, request_id))

    return await once(request, run)


@router.post("/publish", response_model=HandleColumns,
             summary="Publish many versions at once (all of them, or none)")
async def publish_many(req: ManyPublish, request: Request, session: SessionHeader = None,
                       request_id: RequestHeader = None) -> Response:
    require_names(principal_of(request), req.names)
    broker = broker_of(request)

    async def run() -> Response:
        return json_response(_many.publish(broker, session, caller(request), req))

    return await once(request, run)


@router.post("/get", response_model=HandleColumns,
             summary="Lease many tensors at once, under one deadline (all of them, or none)")
async def get_many(req: BatchGet, request: Request, session: SessionHeader = None,
                   request_id: RequestHeader = None) -> Response:
    require_names(principal_of(request), req.names)
    broker, timeout = broker_of(request), _many.wait_of(req)

    async def run() -> Response:
        gone = None if timeout == 0 else (lambda: hangup(request))
        return json_response(await _many.get(broker, session, caller(request), req, request_id,
                                             timeout, gone))

    return await once(request, run)
