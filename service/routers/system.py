"""Health, accounting and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._version import __version__
from ..._wire import Health, Stat
from .._deps import broker_of
from .._metrics import CONTENT_TYPE

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz(request: Request) -> Health:
    broker = broker_of(request)
    return Health(status="shutting_down" if broker.closing else "ok", version=__version__)


@router.get("/v1/stat", response_model=Stat, summary="Memory and lifetime accounting")
async def stat(request: Request) -> Stat:
    return broker_of(request).stat()


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    text: bytes = request.app.state.metrics.render()  # Flight and peers included
    return Response(text, media_type=CONTENT_TYPE)
