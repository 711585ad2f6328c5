"""GPUs: publishing producer-owned CUDA memory, and which blocks still live."""

from __future__ import annotations

from ...._wire import Handle, LiveReply, LiveRequest, ShareRequest
from ..._auth import READ, WRITE
from .._handler import Answer, Call, Reply, route, routes_of
from .._render import handle_json

TAG = "cuda"


@route(
    "POST",
    "/v1/cuda/share",
    WRITE,
    "share_cuda",
    tag=TAG,
    body=ShareRequest,
    answers=Handle,
    once=True,
    note="the name within the prefix",
    summary="Publish a producer's CUDA memory by IPC handle, without a copy",
)
def share(call: Call[ShareRequest]) -> Reply:
    assert call.body is not None
    broker, req = call.broker, call.body

    async def later() -> Answer:
        v = await broker.cuda.share(broker, call.session, call.who, req)
        return 200, handle_json(broker, v)

    return later()


@route(
    "POST",
    "/v1/cuda/live",
    READ,
    "live_cuda",
    tag=TAG,
    body=LiveRequest,
    answers=LiveReply,
    note="which blocks exist; no names",
    summary="Which CUDA blocks and shared allocations still exist, and which are in use",
)
def live(call: Call[LiveRequest]) -> Reply:
    assert call.body is not None
    broker = call.broker
    # What a client says it no longer maps counts only for its own session.
    s = broker.sessions.owned_by(call.session, call.who)
    return 200, broker.cuda.live(
        broker, call.body, None if s is None else s.id
    ).model_dump_json().encode()


ROUTES = routes_of(share, live)
