"""GPUs: publishing producer-owned CUDA memory, and which blocks still live."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._wire import Handle, LiveReply, LiveRequest, ShareRequest
from .._auth import principal_of, require_name
from .._deps import RequestHeader, SessionHeader, broker_of, caller, json_response, once

router = APIRouter(prefix="/v1/cuda", tags=["cuda"])


@router.post("/share", response_model=Handle,
             summary="Publish a producer's CUDA memory by IPC handle, without a copy")
async def share(req: ShareRequest, request: Request, session: SessionHeader = None,
                request_id: RequestHeader = None) -> Response:
    require_name(principal_of(request), req.name)
    broker = broker_of(request)

    async def run() -> Response:
        v = await broker.cuda.share(broker, session, caller(request), req)
        return json_response(broker.handle(v).model_dump_json())

    return await once(request, run)


@router.post("/live", response_model=LiveReply,
             summary="Which CUDA blocks and shared allocations still exist, and which are in use")
async def live(req: LiveRequest, request: Request) -> LiveReply:
    broker = broker_of(request)
    return broker.cuda.live(broker, req)
