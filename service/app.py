"""The FastAPI application: lifespan, error boundary, routers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._errors import DepotError
from .._version import __version__
from .._wire import ErrorBody
from ..shm import PrefixLock, sweep
from ..shm._pool import Pool
from ._broker import Broker
from ._cuda import CudaMemory
from ._deps import PiggybackedReleases, TokenAuth, error_response
from .config import Settings, get_settings, parse_size
from .routers import batch, cuda, sessions, system, tensors

log = logging.getLogger("tensordepot.broker")

# Every route may answer with these; the body is always ErrorBody (FastAPI's
# default 422 schema, {"detail": [...]}, is not what the error boundary sends).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in ((400, "bad input"), (401, "missing or wrong token (TCP only)"),
                         (404, "unknown name or route"), (409, "conflict with the tensor's state"),
                         (422, "malformed request"), (503, "the broker is shutting down"),
                         (507, "out of memory (--max-memory)"))
}


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'request'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the broker app.  ``settings`` defaults to the environment."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cfg: Settings = app.state.settings
        prefix = cfg.prefix()
        lock = PrefixLock(prefix)
        removed = sweep(prefix, keep={lock.name})
        if removed:
            log.warning("removed %d segment(s) left behind by a dead broker", len(removed))
        mode = 0o600 if cfg.gid() is None else 0o660
        pool = Pool(prefix, max_memory=cfg.max_memory_bytes(), segment_size=parse_size(cfg.segment_size),
                    warm_bytes=cfg.warm_memory_bytes(), mode=mode, gid=cfg.gid())
        gpus = CudaMemory(prefix + "cuda-", max_memory=cfg.cuda_memory_bytes(),
                          segment_size=parse_size(cfg.cuda_segment_size))  # nothing on a GPU until used
        broker = Broker(pool, session_ttl=cfg.session_ttl, cuda=gpus)
        app.state.broker = broker
        # Uvicorn re-raises SIGTERM after its graceful shutdown, so code after
        # server.run() never runs: cleanup lives here, in the lifespan.
        try:
            pool.prewarm(parse_size(cfg.prealloc))
            reaper = asyncio.create_task(_reap(broker, cfg.reap_interval))
            try:
                yield
            finally:
                reaper.cancel()
                broker.begin_shutdown()
        finally:
            broker.close()
            lock.release()
            on_close = getattr(app.state, "on_close", None)
            if on_close is not None:
                on_close()

    app = FastAPI(
        title="tensordepot",
        version=__version__,
        summary="Zero-copy tensor exchange between processes on one host.",
        lifespan=lifespan,
    )
    settings = settings or get_settings()
    app.state.settings = settings
    app.add_middleware(tensors.HotPaths)  # innermost of ours: releases and auth come first
    app.add_middleware(PiggybackedReleases)
    if settings.token:  # added last, so it runs first: no release without the token
        app.add_middleware(TokenAuth, token=settings.token)

    @app.exception_handler(DepotError)
    async def _depoterror_response(request: Request, exc: DepotError) -> JSONResponse:
        return error_response(exc.status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", _describe(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "no_such_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}")

    for module in (tensors, batch, sessions, system, cuda):  # hot routes first: matching is linear
        app.include_router(module.router, responses=ERROR_RESPONSES)
    return app


async def _reap(broker: Broker, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            broker.reap()
            broker.expire()
        except Exception:  # keep reaping whatever one pass hit
            log.exception("reaper pass failed")
