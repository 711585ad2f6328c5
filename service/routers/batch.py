"""Batches: a whole state dict in one round trip per step."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._wire import BatchAlloc, BatchGet, BatchPublish, HandleList
from .. import _many
from .._auth import principal_of, require_names
from .._broker import Version
from .._deps import RequestHeader, SessionHeader, broker_of, caller, hangup, json_response, once

router = APIRouter(prefix="/v1/batch", tags=["batch"])


def _handles(request: Request, pairs: list[tuple[Version, int | None]]) -> Response:
    broker = broker_of(request)
    return json_response(HandleList(items=[broker.handle(v, lease) for v, lease in pairs])
                         .model_dump_json())


@router.post("/alloc", response_model=HandleList, summary="Allocate many versions at once")
async def alloc_many(req: BatchAlloc, request: Request, session: SessionHeader = None,
                     request_id: RequestHeader = None) -> Response:
    # before anything is allocated
    require_names(principal_of(request), (i.name for i in req.items))
    broker = broker_of(request)

    async def run() -> Response:
        done: list[tuple[Version, int | None]] = []
        try:
            for item in req.items:
                done.append(await broker.alloc(session, caller(request), item,
                                               request=request_id))
        except BaseException:
            # All or nothing: a batch that does not fit leaves no half-written state dict.
            for v, hold in done:
                if hold is not None:
                    broker.release(session, caller(request), [hold])
                broker.abandon(v)
            raise
        return _handles(request, done)

    return await once(request, run)


@router.post("/publish", response_model=HandleList,
             summary="Publish many versions at once (all of them, or none)")
async def publish_many(req: BatchPublish, request: Request, session: SessionHeader = None,
                       request_id: RequestHeader = None) -> Response:
    require_names(principal_of(request), (i.name for i in req.items))
    broker = broker_of(request)

    async def run() -> Response:
        versions = broker.publish_many(session, caller(request),
                                       [(i.name, i.version) for i in req.items])
        return _handles(request, [(v, None) for v in versions])

    return await once(request, run)


@router.post("/get", response_model=HandleList,
             summary="Lease many tensors at once, under one deadline (all of them, or none)")
async def get_many(req: BatchGet, request: Request, session: SessionHeader = None,
                   request_id: RequestHeader = None) -> Response:
    require_names(principal_of(request), req.names)
    broker, timeout = broker_of(request), _many.wait_of(req)

    async def run() -> Response:
        got = await broker.get_many(session, caller(request), req.names, timeout,
                                    newer_than=req.newer_than or 0, request=request_id,
                                    gone=None if timeout == 0 else lambda: hangup(request))
        return _handles(request, list(got))

    return await once(request, run)
