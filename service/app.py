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
from ._auth import AuthMiddleware, AuthPolicy, check_routes, load_policy
from ._broker import Broker
from ._cuda import CudaMemory
from ._deps import Guard, MarkServer, error_response
from ._lane import Lane
from ._metrics import Metrics, RequestMetrics
from .config import Settings, get_settings, parse_size
from .routers import batch, cuda, many, sessions, system, tensors

log = logging.getLogger("tensordepot.broker")

# Every route may answer with these; the body is always ErrorBody (FastAPI's
# default 422 schema, {"detail": [...]}, is not what the error boundary sends).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in ((400, "bad input"), (401, "no or unknown credentials (a bearer token)"),
                         (403, ("not allowed: a missing scope, a name outside the token's "
                                "prefix, a unix peer whose uid is not admitted, or another "
                                "client's session")),
                         (404, "unknown name or route"), (409, "conflict with the tensor's state"),
                         (413, "request body too large"), (422, "malformed request"),
                         (429, "a per-client limit (sessions)"),
                         (503, "the broker is shutting down"),
                         (507, "out of memory (--max-memory, or a per-session/per-token quota)"))
}


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'request'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def create_app(settings: Settings | None = None, policy: AuthPolicy | None = None) -> FastAPI:
    """Build the broker app.  ``settings`` defaults to the environment, and
    ``policy`` (who may do what) to ``load_policy(settings)``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cfg: Settings = app.state.settings
        prefix = cfg.prefix()
        lock = PrefixLock(prefix)
        removed = sweep(prefix, keep={lock.name})
        if removed:
            log.warning("removed %d segment(s) left behind by a dead broker", len(removed))
        auth: AuthPolicy = app.state.auth_policy
        if auth.insecure_no_auth:
            log.warning("TCP listeners run with --insecure-no-auth: anyone who reaches them may "
                        "read, overwrite and delete every tensor")
        pool = Pool(prefix, max_memory=cfg.max_memory_bytes(),
                    segment_size=parse_size(cfg.segment_size),
                    warm_bytes=cfg.warm_memory_bytes(), mode=auth.segment_mode, gid=auth.file_gid)
        # nothing on a GPU until used
        gpus = CudaMemory(prefix + "cuda-", max_memory=cfg.cuda_memory_bytes(),
                          segment_size=parse_size(cfg.cuda_segment_size))
        broker = Broker(pool, limits=cfg.limits(), cuda=gpus)
        app.state.broker = broker
        # Uvicorn re-raises SIGTERM after its graceful shutdown, so code after
        # server.run() never runs: cleanup lives here, in the lifespan.
        try:
            pool.prewarm(parse_size(cfg.prealloc))
            hosts = None
            if cfg.flight or cfg.peer or getattr(app.state, "flight", None) is not None:
                from ._hosts import connect  # imports pyarrow

                hosts = connect(cfg, broker, auth, getattr(app.state, "flight", None),
                                app.state.metrics)
            reaper = asyncio.create_task(_reap(broker, cfg.reap_interval))
            try:
                yield
            finally:
                reaper.cancel()
                broker.begin_shutdown()
                if hosts is not None:
                    await hosts.close()
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
    app.state.auth_policy = policy = policy or load_policy(settings)
    app.add_middleware(Guard)  # body limits and piggybacked releases, after auth
    # Added after the ones above, so it runs before them: nothing (not even a
    # piggybacked release) happens before the request's principal is known and allowed.
    app.add_middleware(AuthMiddleware, policy=policy)
    # Times every request, refused ones and hot paths included.
    app.state.metrics = Metrics(lambda: getattr(app.state, "broker", None), lambda: app.routes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    app.add_middleware(MarkServer)  # outermost: every answer says who sent it

    @app.exception_handler(DepotError)
    async def _depoterror_response(request: Request, exc: DepotError) -> JSONResponse:
        return error_response(exc.status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", _describe(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "no_such_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, f"{request.method} {request.url.path}: "
                                                     f"{exc.detail}")

    modules = (tensors, batch, many, sessions, system, cuda)
    for module in modules:
        app.include_router(module.router, responses=ERROR_RESPONSES)
    # Included routers are wrapped in app.routes; their own lists hold the routes.
    check_routes([*app.routes, *(r for m in modules for r in m.router.routes)])
    # Matching is linear: the hot routes go first, as plain Starlette routes
    # (their FastAPI declarations above stay for the OpenAPI document).
    app.router.routes[:0] = tensors.HOT_ROUTES
    # The real server's protocol answers the hottest routes itself (service/_lane.py).
    app.state.lane = Lane(app)
    return app


async def _reap(broker: Broker, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            broker.reap()
            broker.expire()
        except Exception:  # keep reaping whatever one pass hit
            log.exception("reaper pass failed")
