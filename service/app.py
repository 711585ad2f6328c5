"""The FastAPI application: the lifespan, the gate and its two doors, the API documents."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .._defaults import parse_size
from .._version import __version__
from ..shm import PrefixLock, sweep
from ..shm._pool import Pool
from ._auth import AuthPolicy, load_policy
from ._http._asgi import AsgiDoor
from ._http._gate import Gate
from ._http._lane import Lane
from ._http._routes import openapi_routes
from ._http._shmlane import ShmLanes
from ._metrics import Metrics
from ._registry._broker import Broker
from ._registry._cuda import CudaMemory
from .config import Settings, get_settings

log = logging.getLogger("tensordepot.broker")


def create_app(settings: Settings | None = None, policy: AuthPolicy | None = None) -> FastAPI:
    """Build the broker app.  ``settings`` defaults to the environment, and
    ``policy`` (who may do what) to ``load_policy(settings)``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cfg: Settings = app.state.settings
        prefix = cfg.prefix()
        # `tensordepot serve` takes the lock before it starts, to refuse in one line
        lock = getattr(app.state, "prefix_lock", None) or PrefixLock(prefix)
        removed = sweep(prefix, keep={lock.name})
        if removed:
            log.warning("removed %d segment(s) left behind by a dead broker", len(removed))
        auth: AuthPolicy = app.state.auth_policy
        if auth.insecure_no_auth:
            log.warning(
                "TCP listeners run with --insecure-no-auth: anyone who reaches them may "
                "read, overwrite and delete every tensor"
            )
        pool = Pool(
            prefix,
            max_memory=cfg.max_memory_bytes(),
            segment_size=parse_size(cfg.segment_size),
            warm_bytes=cfg.warm_memory_bytes(),
            mode=auth.segment_mode,
            gid=auth.file_gid,
        )
        if pool.segment_size != parse_size(cfg.segment_size):
            log.warning(
                "--segment-size %s is more than --max-memory %s: segments are %d bytes instead",
                cfg.segment_size,
                cfg.max_memory,
                pool.segment_size,
            )
        # nothing on a GPU until used
        gpus = CudaMemory(
            prefix + "cuda-",
            max_memory=cfg.cuda_memory_bytes(),
            segment_size=parse_size(cfg.cuda_segment_size),
        )
        broker = Broker(pool, limits=cfg.limits(), cuda=gpus)
        app.state.broker = broker
        if not cfg.no_lane:  # the board lanes pass (shm._board): every name gets a slot on it
            broker.records.board()
        # Uvicorn re-raises SIGTERM after its graceful shutdown, so code after
        # server.run() never runs: cleanup lives here, in the lifespan.
        try:
            pool.prewarm(parse_size(cfg.prealloc))
            hosts = None
            if cfg.flight or cfg.peer or getattr(app.state, "flight", None) is not None:
                from ._hosts._connect import connect  # imports pyarrow

                hosts = connect(
                    cfg, broker, auth, getattr(app.state, "flight", None), app.state.metrics
                )
            lanes: ShmLanes = app.state.shmlanes
            reaper = asyncio.create_task(_reap(broker, lanes, cfg.reap_interval))
            try:
                yield
            finally:
                reaper.cancel()
                lanes.close()
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
    app.state.metrics = Metrics(lambda: getattr(app.state, "broker", None))
    # One gate, two doors: the real server's protocol answers every route it
    # can itself (service/_http/_lane.py); everything else takes the ASGI door, the
    # one middleware, which hands FastAPI only the API documents.
    gate = Gate(app.state, policy, app.state.metrics)
    app.add_middleware(AsgiDoor, gate=gate)
    app.state.lane = Lane(gate)
    app.state.shmlanes = ShmLanes(gate, enabled=not settings.no_lane)  # the third door

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # the route table, documented
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=openapi_routes()
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _reap(broker: Broker, lanes: ShmLanes, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            broker.reap()
            broker.expire()
            lanes.sweep()  # the lanes of the sessions that ended
        except Exception:  # keep reaping whatever one pass hit
            log.exception("reaper pass failed")
