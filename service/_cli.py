"""The ``tensordepot`` command: serve, ls, rm, stat."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from .._defaults import default_url


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .._errors import DepotError
    from ._server import ListenError, PeerCredProtocol, Server, bind_all, close_all
    from .app import create_app
    from .config import Settings, parse_size

    overrides: dict[str, Any] = {k: v for k, v in vars(args).items()
                                 if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**overrides)
        for field in ("max_memory", "warm_memory", "cuda_memory"):
            if getattr(settings, field) != "auto":
                parse_size(getattr(settings, field))
        parse_size(settings.segment_size)
        parse_size(settings.cuda_segment_size)
        parse_size(settings.prealloc)
    except ValueError as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own start/stop lines only at debug: we log one ready line ourselves.
    uvicorn_level = "debug" if logging.getLogger().level <= logging.DEBUG else "warning"
    try:
        listens, socks = bind_all(settings)
    except (ListenError, DepotError, OSError) as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings)
    app.state.on_close = lambda: close_all(listens, socks)
    config = uvicorn.Config(app, http=PeerCredProtocol, lifespan="on", log_config=None,
                            access_log=False, timeout_keep_alive=300, timeout_graceful_shutdown=5,
                            log_level=uvicorn_level)
    urls = ", ".join(ln.url for ln in listens)
    ready = (f"tensordepot ready: pid {os.getpid()}, listening on {urls}, "
             f"max-memory {settings.max_memory_bytes() / 2**30:.1f} GiB, prefix {settings.prefix()}")
    server = Server(config, ready)
    try:
        server.run(sockets=socks)
    finally:
        close_all(listens, socks)
    return 0 if server.started else 1


def _client(args: argparse.Namespace) -> Any:
    from ..client import Client

    return Client(args.url, token=args.token)


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.list()
    if args.json:
        print(json.dumps([i.model_dump() for i in items], indent=2))
        return 0
    print(f"{'NAME':40} {'VER':>5} {'DTYPE':>12} {'SHAPE':20} {'BYTES':>12} {'READERS':>7} STATE")
    for i in items:
        print(f"{i.name:40} {i.version:>5} {i.dtype:>12} {tuple(i.shape)!s:20} {i.nbytes:>12} "
              f"{i.readers:>7} {i.state}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _client(args) as c:
        for name in args.names:
            c.delete(name)
    return 0


def _stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.stat()
    if args.json:
        print(json.dumps(st.model_dump(), indent=2))
    else:
        for key, value in st.model_dump(exclude={"devices"}).items():
            print(f"{key:15} {value}")
        for dev in st.devices:
            ctx = "unknown" if dev.context_bytes is None else dev.context_bytes
            print(f"{dev.device}: in use {dev.bytes_in_use}, reserved {dev.bytes_reserved}, "
                  f"pending {dev.bytes_pending}, shared {dev.bytes_shared}, max {dev.max_memory}, "
                  f"context {ctx}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensordepot", description="Zero-copy tensor exchange broker.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the broker in the foreground",
                       description="Every flag is also an environment variable TENSORDEPOT_<FLAG>.")
    s.add_argument("--listen", action="append", metavar="URL",
                   help="unix:///path.sock or http://host:port (repeatable); "
                        "default unix://<default socket>")
    s.add_argument("--max-memory", help="shared memory the broker may hold, e.g. 8GiB (default: half of /dev/shm)")
    s.add_argument("--segment-size", help="pooled segment size (default 256MiB)")
    s.add_argument("--warm-memory", help="free memory kept warm for reuse (default: min(2GiB, max-memory))")
    s.add_argument("--prealloc", help="pool memory created at start (default 256MiB)")
    s.add_argument("--cuda-memory", help="device memory the broker may hold on each GPU, e.g. 16GiB "
                                         "(default: half of each GPU's memory); nothing is allocated "
                                         "on a GPU until a tensor is placed there")
    s.add_argument("--cuda-segment-size", help="pooled CUDA block size (default 256MiB)")
    s.add_argument("--shm-prefix", help="segment name prefix (default: derived from the first --listen)")
    s.add_argument("--shm-group", help="group allowed to map segments (mode 0660); default: owner only")
    s.add_argument("--token", help="bearer token required on TCP listeners")
    s.add_argument("--reap-interval", type=float, help="seconds between liveness checks (default 0.5)")
    s.add_argument("--session-ttl", type=float, help="heartbeat timeout for untracked sessions (default 15)")
    s.add_argument("--log-level", help="debug, info, warning (default info)")
    s.set_defaults(func=_serve)

    for name, fn, helptext in (("ls", _ls, "list tensors"), ("stat", _stat, "show accounting"),
                               ("rm", _rm, "delete tensors")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--url", default=None, help=f"broker URL (default $TENSORDEPOT_URL or {default_url()})")
        c.add_argument("--token", default=None, help="bearer token for TCP")
        if name == "rm":
            c.add_argument("names", nargs="+", metavar="NAME")
        else:
            c.add_argument("--json", action="store_true", help="print JSON")
        c.set_defaults(func=fn)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        from .._errors import DepotError

        try:
            return int(args.func(args))
        except DepotError as exc:
            print(f"tensordepot {args.command}: {exc}", file=sys.stderr)
            return 1
    return int(args.func(args))
