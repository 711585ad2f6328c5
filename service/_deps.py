"""Dependencies and middleware shared by the routers.

Hot routes declare no FastAPI dependencies at all: solving them costs more
per request than the broker's own work (and a plain ``def`` dependency even
hops to a worker thread).  They take the ``Request`` and the session header
directly.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.responses import JSONResponse

from ._broker import Broker

SESSION_HEADER = "x-tensordepot-session"
RELEASE_HEADER = "x-tensordepot-release"


def peer_pid(request: Request) -> int | None:
    """The pid the kernel reports for a unix-socket peer (SO_PEERCRED), if any."""
    cred = getattr(request.state, "peercred", None)
    return cred[0] if cred else None


SessionHeader = Annotated[str | None, Header(alias=SESSION_HEADER,
                                             description="the id from POST /v1/sessions")]


def broker_of(request: Request) -> Broker:
    """The broker behind this app.

    Routes call this instead of declaring ``Depends(get_broker)``: each
    sub-dependency costs FastAPI more per request than our whole handler, and
    the control plane's speed is the product (issue: B5 against a bare
    endpoint)."""
    broker: Broker = request.app.state.broker
    return broker


def error_response(status: int, code: str, message: str) -> JSONResponse:
    """The one error body: ``{"error": {"code", "message"}}``."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class PiggybackedReleases:
    """ASGI middleware: any request may carry ``x-tensordepot-release: 1,2,3``,
    lease ids the client dropped since its last request.  They are released
    before the request is handled, so dropping tensors costs no round trip of
    its own.  Ids that are not the session's own are ignored."""

    _release = RELEASE_HEADER.encode()
    _session = SESSION_HEADER.encode()

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            ids = sid = None
            for key, value in scope["headers"]:
                if key == self._release:
                    ids = value
                elif key == self._session:
                    sid = value.decode("latin-1")
            if ids and sid:
                # Starlette puts the app in the scope before middleware runs.
                broker: Broker | None = getattr(scope["app"].state, "broker", None)
                try:
                    lease_ids = [int(x) for x in ids.split(b",") if x.strip()]
                except ValueError:
                    lease_ids = []
                if broker is not None and lease_ids:
                    broker.release(sid, lease_ids)
        await self.app(scope, receive, send)
