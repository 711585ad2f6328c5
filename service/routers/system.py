"""Health, accounting and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..._version import __version__
from ..._wire import DeviceStat, Health, Stat
from .._deps import broker_of

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
    broker = broker_of(request)
    st = broker.stat()
    lines = []
    for key, value in st.model_dump(exclude={"devices"}).items():
        lines += [f"# TYPE tensordepot_{key} gauge", f"tensordepot_{key} {value}"]
    for key in [k for k in DeviceStat.model_fields if k != "device"] if st.devices else []:
        lines.append(f"# TYPE tensordepot_cuda_{key} gauge")  # one series per GPU in use
        lines += [f'tensordepot_cuda_{key}{{device="{d.device}"}} {getattr(d, key)}'
                  for d in st.devices if getattr(d, key) is not None]
    for key, value in sorted(broker.counters.items()):
        lines += [f"# TYPE tensordepot_{key}_total counter", f"tensordepot_{key}_total {value}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
