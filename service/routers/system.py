"""Health, accounting and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..._version import __version__
from ..._wire import Health, Stat
from .._deps import BrokerDep

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz(broker: BrokerDep) -> Health:
    return Health(status="shutting_down" if broker.closing else "ok", version=__version__)


@router.get("/v1/stat", response_model=Stat, summary="Memory and lifetime accounting")
async def stat(broker: BrokerDep) -> Stat:
    return broker.stat()


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(broker: BrokerDep) -> Response:
    st = broker.stat()
    lines = []
    for key, value in st.model_dump().items():
        lines += [f"# TYPE tensordepot_{key} gauge", f"tensordepot_{key} {value}"]
    for key, value in sorted(broker.counters.items()):
        lines += [f"# TYPE tensordepot_{key}_total counter", f"tensordepot_{key}_total {value}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
