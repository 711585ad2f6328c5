"""Client sessions: open, heartbeat, fork, claim, close.  Only the identity
that opened a session may use it (403 for anyone else)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._wire import ForkInfo, SessionInfo, SessionOpen
from .._deps import RequestHeader, broker_of, caller, json_response, once

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post("", response_model=SessionInfo, summary="Open a session for a client process")
async def open_session(req: SessionOpen, request: Request) -> SessionInfo:
    # The pid in the body is informational: only SO_PEERCRED makes a session tracked.
    return broker_of(request).open_session(caller(request), req.label)


@router.post("/{session}/heartbeat", status_code=204, summary="Keep a heartbeat session alive")
async def heartbeat(session: str, request: Request) -> Response:
    broker_of(request).heartbeat(session, caller(request))
    return Response(status_code=204)


@router.post("/{session}/fork", response_model=ForkInfo,
             summary="Copy this session's leases into a session for a child about to be forked")
async def fork(session: str, request: Request, request_id: RequestHeader = None) -> Response:
    async def run() -> Response:
        return json_response(
            broker_of(request).fork_session(session, caller(request)).model_dump_json())

    return await once(request, run)


@router.post("/{session}/claim", response_model=SessionInfo,
             summary="Take over the session a parent made for this forked child")
async def claim(session: str, request: Request) -> Response:
    return json_response(
        broker_of(request).claim_session(session, caller(request)).model_dump_json())


@router.delete("/{session}", status_code=204, summary="Close a session, releasing its leases")
async def close_session(session: str, request: Request) -> Response:
    broker_of(request).close_session(session, caller(request))
    return Response(status_code=204)
