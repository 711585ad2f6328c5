"""Dependencies shared by the routers."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from .._errors import AuthError
from ._broker import Broker
from .config import Settings, get_settings

SESSION_HEADER = "x-tensordepot-session"

# Every dependency is ``async def``: FastAPI runs plain ``def`` dependencies
# in a worker thread, and that hop costs more than the whole request.


async def settings_dep(request: Request) -> Settings:
    """The app's settings (``create_app(settings)``), else the environment's.

    ``create_app`` stores them on ``app.state`` rather than in
    ``dependency_overrides``: FastAPI re-analyses an overridden dependency on
    every request, which costs milliseconds."""
    settings: Settings | None = getattr(request.app.state, "settings", None)
    return settings if settings is not None else get_settings()


async def get_broker(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


def peer_pid(request: Request) -> int | None:
    """The pid the kernel reports for a unix-socket peer (SO_PEERCRED), if any."""
    cred = getattr(request.state, "peercred", None)
    return cred[0] if cred else None


async def check_auth(request: Request, settings: Annotated[Settings, Depends(settings_dep)],
               authorization: Annotated[str | None, Header()] = None) -> None:
    """TCP requests need the bearer token when one is configured.  Unix-socket
    peers are authorised by the socket's file mode (0600)."""
    if not settings.token or getattr(request.state, "unix", False):
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), settings.token.encode()):
        raise AuthError("missing or wrong token: send 'Authorization: Bearer <token>' "
                        "(Client(token=...) or $TENSORDEPOT_TOKEN)")


BrokerDep = Annotated[Broker, Depends(get_broker)]
SessionHeader = Annotated[str | None, Header(alias=SESSION_HEADER,
                                             description="the id from POST /v1/sessions")]
