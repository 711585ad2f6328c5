"""Client sessions: open, heartbeat, close."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._errors import Conflict
from ..._wire import SessionInfo, SessionOpen
from .._deps import broker_of, peer_pid

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post("", response_model=SessionInfo, summary="Open a session for a client process")
async def open_session(req: SessionOpen, request: Request) -> SessionInfo:
    return broker_of(request).open_session(req, peer_pid(request))


@router.post("/{session}/heartbeat", status_code=204, summary="Keep an untracked session alive")
async def heartbeat(session: str, request: Request) -> Response:
    broker_of(request).heartbeat(session)
    return Response(status_code=204)


@router.delete("/{session}", status_code=204, summary="Close a session, releasing its leases")
async def close_session(session: str, request: Request) -> Response:
    if not broker_of(request).end_session(session):
        raise Conflict(f"session {session[:8]}... is unknown or already closed")
    return Response(status_code=204)
