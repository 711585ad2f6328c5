"""The ``tensordepot`` command: serve, and the client commands ls, stat, rm, wait.

The client commands import only the client (numpy, pydantic): FastAPI,
uvicorn and the broker load inside ``serve``, so ``tensordepot ls`` costs
little more than ``import tensordepot``.  Every client command takes
``--json``; results go to stdout, problems to stderr, and the exit status is
0 on success, 1 on failure, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from .._defaults import ENV_TOKEN, default_url
from .._version import __version__

log = logging.getLogger("tensordepot.cli")

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_size(n: int) -> str:
    """A byte count for people: ``1610612736`` -> ``"1.5 GiB"``, ``512`` -> ``"512 B"``."""
    if n < 1024:
        return f"{n} B"
    value, k = n / 1024, 0
    while round(value, 1) >= 1024 and k < len(_UNITS) - 1:  # 1023.96 KiB shows as 1 MiB
        value, k = value / 1024, k + 1
    return f"{value:.1f}".removesuffix(".0") + " " + _UNITS[k]


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# -- serve ----------------------------------------------------------------------------------------


def _check_sizes(settings: Any) -> int:
    """Parse every size setting; return --max-memory in bytes.  Raises ValueError."""
    from .config import parse_size

    for field in ("max_memory", "warm_memory", "segment_size", "prealloc", "max_memory_per_session",
                  "max_memory_per_token", "cuda_memory", "cuda_segment_size"):
        value = getattr(settings, field)
        if value == "auto" and field in ("max_memory", "warm_memory", "cuda_memory"):
            continue
        try:
            parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{_flag(field)}: {exc}") from None
    max_memory: int = settings.max_memory_bytes()
    if max_memory <= 0:
        raise ValueError(
            f"{_flag('max_memory')} is {settings.max_memory!r}, which leaves no memory for "
            f"tensors; give a size such as 8GiB, or leave it out for half of /dev/shm"
        )
    return max_memory


def _flag(field: str) -> str:
    return f"--{field.replace('_', '-')} (or $TENSORDEPOT_{field.upper()})"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .._errors import DepotError
    from ._auth import AuthConfigError, load_policy
    from ._server import ListenError, PeerCredProtocol, Server, bind_all, close_all
    from .app import create_app
    from .config import Settings, shm_capacity

    overrides: dict[str, Any] = {k: v for k, v in vars(args).items()
                                 if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**overrides)
        max_memory = _check_sizes(settings)
    except ValueError as exc:
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    capacity = shm_capacity()
    if max_memory > capacity:
        log.warning("--max-memory %s is more than /dev/shm holds (%s): puts will fail with "
                    "out of memory once /dev/shm is full; lower --max-memory or enlarge "
                    "/dev/shm (docker: shm_size)", format_size(max_memory), format_size(capacity))
    if args.token is not None:
        logging.getLogger("tensordepot.broker").warning(
            "--token is visible to every local user in the process list (/proc/%d/cmdline); "
            "use --token-file or TENSORDEPOT_TOKEN", os.getpid())
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
    try:
        flight = _bind_hosts(settings, policy)
    except ListenError as exc:
        close_all(listens, socks)
        print(f"tensordepot serve: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings, policy)
    app.state.flight = flight
    app.state.on_close = lambda: close_all(listens, socks)
    PeerCredProtocol.max_connections = settings.max_connections
    _raise_fd_limit()
    config = uvicorn.Config(app, http=PeerCredProtocol, lifespan="on", log_config=None,
                            access_log=False, timeout_keep_alive=120, timeout_graceful_shutdown=5,
                            log_level=uvicorn_level)
    urls = ", ".join(ln.url for ln in listens)
    if flight is not None:
        urls += f", flight {flight.url}"
    if settings.peer:
        urls += f", peers {', '.join(settings.peer)}"
    ready = (f"tensordepot ready: pid {os.getpid()}, listening on {urls}, "
             f"max-memory {max_memory / 2**30:.1f} GiB, prefix {settings.prefix()}")
    server = Server(config, ready)
    try:
        server.run(sockets=socks)
    finally:
        close_all(listens, socks)
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
    from ._server import ListenError

    if not (settings.flight or settings.peer):
        return None
    try:
        from ..shm._arrow import import_flight, parse_flight_url

        import_flight()
        from ._flight import bind_flight

        for url in settings.peer:
            parse_flight_url(url, "--peer")
        if settings.peer_tls_ca and not os.path.isfile(settings.peer_tls_ca):
            raise ValueError(f"--peer-tls-ca {settings.peer_tls_ca}: no such file")
    except (ImportError, ValueError) as exc:
        raise ListenError(str(exc)) from None
    return bind_flight(settings, policy) if settings.flight else None


# -- client commands ------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from ..client import Client

    if args.token is not None:
        print("tensordepot: --token is visible to every local user in the process list; "
              "prefer $TENSORDEPOT_TOKEN", file=sys.stderr)
    return Client(args.url, token=args.token)


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.list()
    if args.json:
        _print_json([i.model_dump() for i in items])
        return 0
    rows = [(i.name, str(i.version), i.dtype, str(tuple(i.shape)),
             str(i.nbytes) if args.bytes else format_size(i.nbytes), str(i.readers), i.state)
            for i in items]
    head = ("NAME", "VER", "DTYPE", "SHAPE", "BYTES" if args.bytes else "SIZE", "READERS", "STATE")
    widths = [max([len(head[k])] + [len(r[k]) for r in rows]) for k in range(len(head))]
    right = {1, 4, 5}  # numbers line up on the right
    for row in [head, *rows]:
        cells = [cell.rjust(w) if k in right else cell.ljust(w)
                 for k, (cell, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells).rstrip())
    return 0


def _stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.stat().model_dump()
    if args.json:
        _print_json(st)
        return 0
    devices = st.pop("devices", [])
    for key, value in st.items():
        sized = "bytes" in key or "memory" in key
        print(f"{key:15} {format_size(value) if sized and not args.bytes else value}")
    for dev in devices:
        size = (lambda n: str(n)) if args.bytes else format_size
        ctx = "unknown" if dev["context_bytes"] is None else size(dev["context_bytes"])
        print(f"{dev['device']}: in use {size(dev['bytes_in_use'])}, reserved "
              f"{size(dev['bytes_reserved'])}, pending {size(dev['bytes_pending'])}, shared "
              f"{size(dev['bytes_shared'])}, max {size(dev['max_memory'])}, context {ctx}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from .._errors import InvalidRequest, TensorNotFound

    deleted: list[str] = []
    missing: list[str] = []
    refused: dict[str, str] = {}
    with _client(args) as c:
        for name in args.names:  # one bad name does not stop the others
            try:
                c.delete(name)
            except TensorNotFound:
                missing.append(name)
                print(f"tensordepot rm: cannot remove {name!r}: no such tensor", file=sys.stderr)
            except InvalidRequest as exc:
                refused[name] = str(exc)
                print(f"tensordepot rm: cannot remove {name!r}: {exc}", file=sys.stderr)
            else:
                deleted.append(name)
    if args.json:
        _print_json({"deleted": deleted, "missing": missing, "refused": refused})
    return 1 if missing or refused else 0


def _wait(args: argparse.Namespace) -> int:
    from .._errors import BrokerUnavailable
    from ..client._transport import Transport

    url = args.url or default_url()
    start = time.monotonic()
    deadline = start + args.timeout
    transport = Transport(url, token=args.token or os.environ.get(ENV_TOKEN))
    why = "nothing answered"
    try:
        while True:
            try:
                # /healthz needs no session and no token; it says "ok" once the
                # broker serves, and "shutting_down" while an old one exits.
                health = transport.request("GET", "/healthz",
                                           timeout=max(deadline - time.monotonic(), 0.05))
            except BrokerUnavailable as exc:
                why = str(exc)
            else:
                if isinstance(health, dict) and health.get("status") == "ok":
                    waited = time.monotonic() - start
                    if args.json:
                        _print_json({"url": url, "status": "ok", "version": health.get("version"),
                                     "waited": round(waited, 3)})
                    else:
                        print(f"broker ready at {url} (tensordepot {health.get('version')}, "
                              f"waited {waited:.2f} s)")
                    return 0
                why = f"the broker answered {health!r}"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
    finally:
        transport.close()
    print(f"tensordepot wait: no broker answered at {url} within {args.timeout:g} s ({why}); "
          f"start one with `tensordepot serve`, or point --url (or $TENSORDEPOT_URL) at its socket",
          file=sys.stderr)
    return 1


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _push(args: argparse.Namespace) -> int:
    with _client(args) as c:
        for name in args.names:
            version = c.push(name, args.to, token=args.to_token, tls_ca=args.tls_ca)
            print(f"{name}: version {version} at {args.to}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensordepot", description="Zero-copy tensor exchange broker.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the broker in the foreground",
                       description="Every flag is also an environment variable TENSORDEPOT_<FLAG>.")
    s.add_argument("--listen", action="append", metavar="URL",
                   help="unix:///path.sock or http://host:port (repeatable); "
                        "default unix://<default socket>")
    s.add_argument("--max-memory", help="shared memory the broker may hold, more than 0, "
                                        "e.g. 8GiB (default: half of /dev/shm)")
    s.add_argument("--segment-size", help="pooled segment size (default 256MiB)")
    s.add_argument("--warm-memory",
                   help="free memory kept warm for reuse (default: min(2GiB, max-memory))")
    s.add_argument("--prealloc", help="pool memory created at start (default 256MiB)")
    s.add_argument("--cuda-memory", help="device memory the broker may hold on each GPU, e.g. "
                                         "16GiB (default: half of each GPU's memory); nothing is "
                                         "allocated on a GPU until a tensor is placed there")
    s.add_argument("--cuda-segment-size", help="pooled CUDA block size (default 256MiB)")
    s.add_argument("--shm-prefix", help="segment name prefix (default: derived from the first "
                                        "--listen)")
    s.add_argument("--shm-group", metavar="GROUP",
                   help="group of the socket (0660) and the segments (0640: the group maps them "
                        "read-only; 0660 with --allow-uid/--allow-gid); default: owner only (0600)")
    s.add_argument("--allow-uid", action="append", metavar="UID",
                   help="also admit this user on the unix socket, as admin (repeatable; needs "
                        "--shm-group, a group it is in)")
    s.add_argument("--allow-gid", action="append", metavar="GID",
                   help="also admit members of this group on the unix socket, as admin; the socket "
                        "and segments become group GID, mode 0660")
    s.add_argument("--token-file", metavar="PATH",
                   help="bearer tokens, one per line: '<token> <scope> [prefix=<p>] [name=<n>]', "
                        "scope read, write or admin; mode 0600")
    s.add_argument("--token", help="an admin bearer token (visible in the process list: prefer "
                                   "--token-file or TENSORDEPOT_TOKEN)")
    s.add_argument("--insecure-no-auth", action="store_true", default=None,
                   help="let TCP listeners run without a token (anyone who reaches them may do "
                        "anything)")
    s.add_argument("--reap-interval", type=float,
                   help="seconds between liveness checks (default 0.5)")
    s.add_argument("--session-ttl", type=float,
                   help="heartbeat timeout for untracked sessions (default 15)")
    s.add_argument("--alloc-ttl", type=float,
                   help="seconds an allocation may stay unpublished before it is reclaimed "
                        "(default 600; 0: never)")
    s.add_argument("--max-sessions", type=int,
                   help="sessions the broker holds at most (default 16384)")
    s.add_argument("--max-sessions-per-peer", type=int,
                   help="sessions one process, or one token over TCP, may hold (default 256)")
    s.add_argument("--max-memory-per-session", help="bytes one session may hold, e.g. 1GiB "
                                                    "(default: no limit)")
    s.add_argument("--max-memory-per-token",
                   help="bytes one identity (a uid, or a token) may hold, e.g. 4GiB (default: no "
                        "limit)")
    s.add_argument("--max-connections", type=int,
                   help="open connections; beyond it the longest-idle one is closed (default 4096)")
    s.add_argument("--log-level", help="debug, info, warning (default info)")
    hosts = s.add_argument_group("across hosts (Arrow Flight; pip install 'tensordepot[flight]')")
    hosts.add_argument("--flight", metavar="URL",
                       help="serve tensors to other hosts: grpc://HOST:PORT or grpc+tls://HOST:PORT")
    hosts.add_argument("--flight-tls-cert", metavar="PEM", help="certificate for grpc+tls://")
    hosts.add_argument("--flight-tls-key", metavar="PEM", help="private key for grpc+tls://")
    hosts.add_argument("--peer", action="append", metavar="URL",
                       help="pull tensors missing here from this broker's --flight URL "
                            "(repeatable)")
    hosts.add_argument("--peer-refresh", type=float, metavar="S",
                       help="seconds a replica is served before its peers are asked for a newer "
                            "version; 0: on every get (default 1)")
    hosts.add_argument("--peer-timeout", type=float, metavar="S",
                       help="seconds to wait for a peer's answer or next chunk (default 5)")
    hosts.add_argument("--peer-token",
                       help="token sent to peers (default: --token); prefer "
                            "TENSORDEPOT_PEER_TOKEN, argv is visible to other users")
    hosts.add_argument("--peer-tls-ca", metavar="PEM", help="CA bundle for grpc+tls:// peers")
    s.set_defaults(func=_serve)

    commands = (("ls", _ls, "list tensors"), ("stat", _stat, "show memory and lifetime accounting"),
                ("rm", _rm, "delete tensors; goes on past missing names (exit 1 if any)"),
                ("wait", _wait, "wait until the broker answers (exit 0), or time out (exit 1)"))
    for name, fn, helptext in commands:
        c = sub.add_parser(name, help=helptext, description=helptext)
        c.add_argument("--url", default=None,
                       help=f"broker URL (default $TENSORDEPOT_URL or {default_url()})")
        c.add_argument("--token", default=None,
                       help="bearer token for TCP (default $TENSORDEPOT_TOKEN)")
        c.add_argument("--json", action="store_true", help="print JSON")
        if name in ("ls", "stat"):
            c.add_argument("--bytes", action="store_true", help="sizes as byte counts, not 1.5 GiB")
        if name == "rm":
            c.add_argument("names", nargs="+", metavar="NAME")
        if name == "wait":
            c.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                           help="give up after S seconds (default 30)")
        c.set_defaults(func=fn)

    push = sub.add_parser("push", help="send tensors to a broker on another host (Arrow Flight)")
    push.add_argument("names", nargs="+", metavar="NAME")
    push.add_argument("--to", required=True, metavar="URL",
                      help="the other broker's --flight URL, grpc://HOST:PORT or "
                           "grpc+tls://HOST:PORT")
    push.add_argument("--url", default=None,
                      help=f"local broker URL (default $TENSORDEPOT_URL or {default_url()})")
    push.add_argument("--token", default=None, help="bearer token for the local broker over TCP")
    push.add_argument("--to-token", default=None,
                      help="token for the other broker (default $TENSORDEPOT_PEER_TOKEN)")
    push.add_argument("--tls-ca", default=None, metavar="PEM",
                      help="CA bundle for a grpc+tls:// --to")
    push.set_defaults(func=_push)
    return p


def _closed_pipe() -> int:
    """The reader of stdout went away (``tensordepot ls | head -1``).

    Python ignores SIGPIPE, so the write raised EPIPE instead of ending the
    process.  Point stdout at /dev/null, so that the interpreter's last flush
    cannot fail again, and exit as the shell reports a tool that SIGPIPE
    ended (128 + 13), without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return int(args.func(args))
    from .._errors import DepotError

    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except DepotError as exc:
        print(f"tensordepot {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return rc
