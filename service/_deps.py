"""Dependencies and middleware shared by the routers.

Every dependency is ``async def``: FastAPI runs plain ``def`` dependencies in
a worker thread, and that hop costs more than a whole request here.
"""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Any

from fastapi import Depends, Header, Request

from .._errors import AuthError, InvalidRequest
from ._broker import Broker

SESSION_HEADER = "x-tensordepot-session"
RELEASE_HEADER = "x-tensordepot-release"


async def get_broker(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


def peer_pid(request: Request) -> int | None:
    """The pid the kernel reports for a unix-socket peer (SO_PEERCRED), if any."""
    cred = getattr(request.state, "peercred", None)
    return cred[0] if cred else None


BrokerDep = Annotated[Broker, Depends(get_broker)]


async def session_dep(
    broker: BrokerDep,
    session: Annotated[str | None, Header(alias=SESSION_HEADER,
                                          description="the id from POST /v1/sessions")] = None,
    release: Annotated[str | None, Header(alias=RELEASE_HEADER,
                                          description="lease ids to release first, comma separated")] = None,
) -> str | None:
    """The caller's session id.  Releases the client piggybacks on any request
    are applied first, so dropping tensors costs no round trip of its own."""
    if release:
        try:
            ids = [int(x) for x in release.split(",") if x.strip()]
        except ValueError:
            raise InvalidRequest(f"{RELEASE_HEADER} must be comma-separated lease ids") from None
        broker.release(session, ids)
    return session


SessionDep = Annotated[str | None, Depends(session_dep)]


class TokenAuth:
    """ASGI middleware: TCP requests need ``Authorization: Bearer <token>`` when
    a token is configured.  Unix-socket peers are authorised by the socket's
    file mode (0600); /healthz stays open for health checks."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and not scope.get("state", {}).get("unix")
                and scope["path"] != "/healthz" and not self._ok(scope)):
            err = AuthError("missing or wrong token: send 'Authorization: Bearer <token>' "
                            "(Client(token=...) or $TENSORDEPOT_TOKEN)")
            body = json.dumps({"error": {"code": err.code, "message": str(err)}}).encode()
            await send({"type": "http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Any) -> bool:
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.token)
        return False
