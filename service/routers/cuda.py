"""GPUs: publishing producer-owned CUDA memory, and which blocks still live."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._wire import Handle, LiveReply, LiveRequest, ShareRequest
from .._deps import SessionHeader, broker_of

router = APIRouter(prefix="/v1/cuda", tags=["cuda"])


@router.post("/share", response_model=Handle,
             summary="Publish a producer's CUDA memory by IPC handle, without a copy")
async def share(req: ShareRequest, request: Request, session: SessionHeader = None) -> Response:
    broker = broker_of(request)
    v = broker.cuda.share(broker, session, req)
    return Response(broker.handle(v).model_dump_json(), media_type="application/json")


@router.post("/live", response_model=LiveReply,
             summary="Which CUDA blocks and shared allocations still exist, and which are in use")
async def live(req: LiveRequest, request: Request) -> LiveReply:
    broker = broker_of(request)
    return broker.cuda.live(broker, req)
