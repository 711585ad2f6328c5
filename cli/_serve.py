"""``tensordepot serve``: the broker in the foreground.

FastAPI, uvicorn and the broker load here, inside ``serve``, never for the
client commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ._commands import format_size
from ._flags import flag, where

log = logging.getLogger("tensordepot.cli")


def _settings(args: argparse.Namespace) -> Any:
    """The broker's ``Settings``: the flags given, then the environment.
    Raises ValueError, with one line per bad setting."""
    from pydantic import ValidationError

    from ..service.config import Settings

    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{where(field)}: {msg}" if field in Settings.model_fields else msg)
        raise ValueError("; ".join(lines)) from None
    max_memory: int = settings.max_memory_bytes()
    if max_memory <= 0:
        raise ValueError(
            f"{where('max_memory')} is {settings.max_memory!r}, which leaves no memory for "
            f"tensors; give a size such as 8GiB, or leave it out for half of /dev/shm"
        )
    return settings


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .._errors import DepotError
    from ..service._auth import AuthConfigError, load_policy
    from ..service._http._server import PeerCredProtocol, Server, bind_all, close_all
    from ..service.app import create_app
    from ..service.config import ListenError, shm_capacity
    from ..shm import PrefixLock, PrefixLockError

    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 2
    max_memory = settings.max_memory_bytes()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    capacity = shm_capacity()
    if max_memory > capacity:
        log.warning(
            "--max-memory %s is more than /dev/shm holds (%s): puts will fail with "
            "out of memory once /dev/shm is full; lower --max-memory or enlarge "
            "/dev/shm (docker: shm_size)",
            format_size(max_memory),
            format_size(capacity),
        )
    if args.token is not None:
        logging.getLogger("tensordepot.broker").warning(
            "--token is visible to every local user in the process list (/proc/%d/cmdline); "
            "use --token-file or TENSORDEPOT_TOKEN",
            os.getpid(),
        )
    try:
        policy = load_policy(settings)
    except AuthConfigError as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 2
    # uvicorn's own start/stop lines only at debug: we log one ready line ourselves.
    uvicorn_level = "debug" if logging.getLogger().level <= logging.DEBUG else "warning"
    try:
        listens, socks = bind_all(settings, policy)
    except (ListenError, DepotError, OSError) as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 1
    try:  # after the sockets: a live broker on the same socket is named as such
        lock = PrefixLock(settings.prefix())
    except (PrefixLockError, OSError) as exc:
        close_all(listens, socks)
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 1
    try:
        flight = _bind_hosts(settings, policy)
    except ListenError as exc:
        lock.release()
        close_all(listens, socks)
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings, policy)
    app.state.flight = flight
    app.state.prefix_lock = lock
    app.state.on_close = lambda: close_all(listens, socks)
    PeerCredProtocol.max_connections = settings.max_connections
    _raise_fd_limit()
    config = uvicorn.Config(
        app,
        http=PeerCredProtocol,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
        log_level=uvicorn_level,
    )
    urls = ", ".join(ln.url for ln in listens)
    if flight is not None:
        urls += f", flight {flight.url}"
    if settings.peer:
        urls += f", peers {', '.join(settings.peer)}"
    ready = (
        f"tensordepot ready: pid {os.getpid()}, listening on {urls}, "
        f"max-memory {max_memory / 2**30:.1f} GiB, prefix {settings.prefix()}"
    )
    server = Server(config, ready)
    try:
        server.run(sockets=socks)
    finally:
        close_all(listens, socks)
        lock.release()  # the lifespan releases it; not when the app never started
        if flight is not None:  # when the app never started, nothing else stops it
            flight.shutdown()
    return 0 if server.started else 1


def _raise_fd_limit() -> None:
    """Every connection is a file descriptor: allow as many as the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def _bind_hosts(settings: Any, policy: Any) -> Any:
    """The Flight endpoint, listening (or None), after checking the peer
    settings, so that a bad address fails here and not in the running broker."""
    from ..service.config import ListenError

    if not (settings.flight or settings.peer):
        return None
    try:
        from ..shm._arrow import import_flight, parse_flight_url

        import_flight()
        from ..service._hosts._flight import bind_flight

        for url in settings.peer:
            parse_flight_url(url, flag("peer"))
        if settings.peer_tls_ca and not os.path.isfile(settings.peer_tls_ca):
            raise ValueError(f"{flag('peer_tls_ca')} {settings.peer_tls_ca}: no such file")
    except (ImportError, ValueError) as exc:
        raise ListenError(str(exc)) from None
    return bind_flight(settings, policy) if settings.flight else None
