"""Binding the listeners and running uvicorn.

We bind every socket ourselves and hand them to ``Server.serve(sockets=...)``:

* uvicorn's ``uds=`` option creates the socket with mode 0666 (any local
  user could connect); ours is created under umask 077 and chmod 0600 (0660
  for a configured group);
* the socket's directory must be the broker's own: created 0700 (0750 for a
  group) when missing, and refused when it belongs to someone else or others
  may write it, since whoever can write the directory can swap the socket
  for their own and receive every client's tensors;
* a stale socket file from a dead broker is replaced, but a live broker on
  the same path makes us refuse to start;
* TCP listeners, loopback included, require a token (or --insecure-no-auth).

The ASGI scope carries no peer credentials, so ``PeerCredProtocol`` (a
subclass of uvicorn's httptools protocol, pinned in pyproject.toml) reads
SO_PEERCRED and SO_PEERGROUPS when a unix connection is made and exposes them
as ``request.state.peercred`` and ``request.state.peergroups``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import ipaddress
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from itertools import chain
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..._errors import (
    BrokerUnavailable,
    DepotError,
    HeadersTooLarge,
    InvalidRequest,
    error_body,
)
from ..._ids import describe_uid
from ..._proto import MAX_HEADER_BYTES, REASONS, SERVER_HEADER
from ..._version import __version__
from .._auth import AuthPolicy
from ..config import ListenError, Settings
from ._lane import Lane, LaneRequest

log = logging.getLogger("tensordepot.broker")

# New objects (net of those freed) between collections of the youngest
# generation, for the broker (``Server.startup``); Python's default is 700.
YOUNG_OBJECTS = 20_000


@dataclass(frozen=True)
class Listen:
    url: str
    family: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def loopback(self) -> bool:
        if self.family == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_listen(url: str) -> Listen:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path.startswith("/"):
            raise ListenError(f"--listen {url!r}: use an absolute path, unix:///run/x.sock")
        return Listen(url, "unix", path=path)
    if parts.scheme == "http":
        if not parts.hostname or parts.port is None:
            raise ListenError(f"--listen {url!r}: give host and port, e.g. http://127.0.0.1:7420")
        return Listen(url, "tcp", host=parts.hostname, port=parts.port)
    raise ListenError(f"--listen {url!r}: use unix:///path.sock or http://host:port")


def _refuse_dir(path: str, st: os.stat_result, problem: str, fix: str) -> ListenError:
    return ListenError(
        f"the socket directory {path} {problem} (owner uid {describe_uid(st.st_uid)}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}); whoever can write it can replace the socket with their "
        f"own and receive your clients' tensors. {fix}, or use --listen "
        "unix:///<a directory of yours>/broker.sock: a missing directory is created with mode "
        "0700"
    )


def _socket_dir(path: str, policy: AuthPolicy) -> None:
    """Create the socket's directory (0700, or 0750 with the policy's group), or
    check that an existing one is safe: ours, and writable by nobody else, and
    its ancestors writable only by us or root (or sticky, like /tmp)."""
    parent = os.path.dirname(path)
    me = policy.broker_uid
    if not os.path.lexists(parent):
        os.makedirs(parent, mode=policy.dir_mode, exist_ok=True)
        if policy.file_gid is not None:
            os.chown(parent, -1, policy.file_gid)
        os.chmod(parent, policy.dir_mode)  # makedirs' mode is filtered by the umask
    lst = os.lstat(parent)
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (me, 0):
        raise _refuse_dir(
            parent, lst, "is a symlink owned by someone else", f"Remove it (rm {parent})"
        )
    st = os.stat(parent)
    if st.st_uid != me:
        raise _refuse_dir(
            parent,
            st,
            f"belongs to another user, not to this broker's uid {describe_uid(me)}",
            f"Remove it as its owner or root (rm -r {parent})",
        )
    if st.st_mode & 0o022:
        raise _refuse_dir(parent, st, "is writable by group or others", f"Run chmod go-w {parent}")
    # Each ancestor: only we or root may rename entries in it (sticky dirs
    # such as /tmp let no one rename another user's entry).
    real = os.path.realpath(parent)
    up = os.path.dirname(real)
    while True:
        ast = os.stat(up)
        sticky = bool(ast.st_mode & stat.S_ISVTX)
        if ast.st_uid not in (me, 0) or (ast.st_mode & 0o022 and not sticky):
            raise _refuse_dir(
                up,
                ast,
                f"(above the socket directory {parent}) lets another user rename what it holds",
                "Choose a path under directories you own",
            )
        if up == os.path.dirname(up):
            break
        up = os.path.dirname(up)
    if policy.file_gid is not None:
        reachable = st.st_mode & 0o001 or (st.st_gid == policy.file_gid and st.st_mode & 0o010)
        if not reachable:
            raise ListenError(
                f"the socket directory {parent} (mode {stat.S_IMODE(st.st_mode):04o}) does not let "
                f"group {policy.file_gid} reach the socket; run chgrp {policy.file_gid} {parent} "
                f"&& chmod 0750 {parent}, or use a directory the broker creates itself"
            )


def _bind_unix(path: str, policy: AuthPolicy) -> socket.socket:
    _socket_dir(path, policy)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ListenError(f"{path} exists and is not a socket; remove it or pick another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its broker is gone
        else:
            raise ListenError(
                f"a live broker already listens on {path}; stop it first "
                f"(tensordepot stat --url unix://{path} shows it) or use another --listen"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600, with no window at 0666
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if policy.file_gid is not None:
        os.chown(path, -1, policy.file_gid)
    os.chmod(path, policy.socket_mode)
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another broker running?"
        ) from None
    sock.listen(1024)
    return sock


def bind_all(settings: Settings, policy: AuthPolicy) -> tuple[list[Listen], list[socket.socket]]:
    listens = [parse_listen(u) for u in settings.listen_urls()]
    for ln in listens:
        if ln.family == "tcp" and not policy.tokens and not policy.insecure_no_auth:
            where = "every local user (loopback too)" if ln.loopback else "anyone who reaches it"
            raise ListenError(
                f"--listen {ln.url} needs a token: {where} could otherwise read, overwrite and "
                f"delete every tensor. Give --token-file PATH (or TENSORDEPOT_TOKEN); to run "
                f"without authentication anyway, add --insecure-no-auth"
            )
    socks: list[socket.socket] = []
    try:
        for ln in listens:
            socks.append(
                _bind_unix(ln.path, policy) if ln.family == "unix" else _bind_tcp(ln.host, ln.port)
            )
    except BaseException:
        close_all(listens[: len(socks)], socks)  # only what we bound: never a live broker's socket
        raise
    return listens, socks


def close_all(listens: list[Listen], socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    for ln in listens:
        if ln.family == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ln.path)


# Linux's SO_PEERGROUPS (4.13+; the socket module has no name for it): the
# peer's supplementary groups, as the kernel saw them at connect(2).
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def _peer_groups(sock: Any) -> tuple[int, ...]:
    size = 64 * 4
    while size <= 65536 * 4:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:  # more groups than the buffer holds
                size *= 4
                continue
            return ()  # an older kernel: the primary gid (SO_PEERCRED) still counts
        return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    return ()


def _raw_error(exc: DepotError) -> bytes:
    """A whole HTTP answer for ``exc``, for a connection closed after it."""
    body = error_body(exc)
    return (
        f"HTTP/1.1 {exc.status} {REASONS[exc.status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{SERVER_HEADER}: {__version__}\r\n"
        f"connection: close\r\n\r\n"
    ).encode() + body


class PeerCredProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus the peer's identity, plus what keeps
    one peer from starving the rest:

    * the peer's (pid, uid, gid) and supplementary groups on unix sockets, from
      SO_PEERCRED and SO_PEERGROUPS, and a dict private to the connection
      (``state["connection"]``);
    * a request head larger than ``MAX_HEADER_BYTES`` is answered 431 and the
      connection closed, before uvicorn collects it;
    * at most ``max_connections`` connections: a new one beyond that closes
      the connection that has been idle longest, or is refused with 503 if
      none is idle."""

    max_connections = 4096
    _in_head = True
    _head = 0
    _last_active = 0.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._lane = getattr(getattr(self.config.app, "state", None), "lane", None)
        self._last_active = time.monotonic()
        sock = transport.get_extra_info("socket")
        cred = None
        groups: tuple[int, ...] = ()
        unix = sock is not None and sock.family == socket.AF_UNIX
        if unix:
            fmt = "3i"
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
            cred = struct.unpack(fmt, raw)
            groups = _peer_groups(sock)
        # app_state is copied into each request's scope["state"]; this
        # connection gets its own copy with the peer in it.
        self.app_state = {
            **self.app_state,
            "peercred": cred,
            "peergroups": groups,
            "unix": unix,
            "connection": {},
        }
        if len(self.connections) > self.max_connections and not self._evict_idle():
            transport.write(
                _raw_error(
                    BrokerUnavailable(
                        f"the broker has {self.max_connections} connections open "
                        f"(--max-connections) and none is idle; retry later"
                    )
                )
            )
            transport.close()

    def _evict_idle(self) -> bool:
        """Make room for this connection, if the live ones (not closing
        already) exceed the limit: close the one idle longest.  False when
        none is idle.  A connection evicted earlier, still closing, neither
        counts nor makes room, so a burst cannot evict the same one again."""
        live = [c for c in self.connections if not c.transport.is_closing()]
        if len(live) <= self.max_connections:
            return True
        idle = [
            c
            for c in live
            if c is not self
            and isinstance(c, PeerCredProtocol)
            and (c.cycle is None or c.cycle.response_complete)
        ]
        if not idle:
            return False
        min(idle, key=lambda c: c._last_active).transport.close()
        return True

    def data_received(self, data: bytes) -> None:
        self._last_active = time.monotonic()
        if self._in_head:
            self._head += len(data)
        super().data_received(data)
        if self._in_head and self._head > MAX_HEADER_BYTES:
            self._refuse_head()

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser cannot read: the one error body, marked
        as every answer of the broker, instead of uvicorn's plain text."""
        if not self.transport.is_closing():
            self.transport.write(
                _raw_error(
                    InvalidRequest(f"{msg} Send HTTP/1.1 with an ASCII request line and headers.")
                )
            )
            self.transport.close()

    _refused = False  # answered 431: what the parser still hands over is dropped

    def _refuse_head(self) -> None:
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(
                _raw_error(HeadersTooLarge(f"the request head is over {MAX_HEADER_BYTES} bytes"))
            )
            self.transport.close()
        self._lane_req = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    # The fast lane (service/_http/_lane.py) takes the hottest routes here; every
    # other request goes through ASGI as uvicorn runs it.
    _lane: Lane | None = None
    _lane_req: LaneRequest | None = None

    def on_headers_complete(self) -> None:
        self._in_head, self._head = False, 0
        # The head's size as the parser handed it over (its URL and headers,
        # each header with its ": " and CRLF): a head that arrives whole in
        # one read is parsed, and would be dispatched, within data_received,
        # before the byte count there could refuse it.
        heads = self.headers
        if (
            len(self.url) + 4 * len(heads) + sum(map(len, chain.from_iterable(heads)))
            > MAX_HEADER_BYTES
        ):
            self._refuse_head()
        if self._refused:
            return
        lane = self._lane
        req = None if lane is None else lane.take(self)
        if req is None:
            super().on_headers_complete()
        elif lane is not None and lane.refuse_now(self, req):
            self._refused = True  # answered and closing: the body is never read
        else:
            self._lane_req = req

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        if self._lane_req is not None and self._lane is not None:
            self._lane.body(self._lane_req, body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        req, self._lane_req = self._lane_req, None
        if req is not None and self._lane is not None:
            self._lane.run(self, req)
        else:
            super().on_message_complete()


class Server(uvicorn.Server):
    """uvicorn.Server that wakes long polls before it waits for requests to
    finish (a get waiting forever would otherwise hold shutdown), and logs one
    line when ready."""

    def __init__(self, config: uvicorn.Config, ready_message: str) -> None:
        super().__init__(config)
        self.ready_message = ready_message

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        # uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown, which makes
        # the process die by the signal; the lifespan has already cleaned up, so
        # exit normally (status 0) instead.
        main = threading.current_thread() is threading.main_thread()
        # SIGHUP too (uvicorn leaves it to its default, death with every
        # segment left in /dev/shm): a broker started in a terminal with
        # `tensordepot serve &` gets it when that terminal closes.  Unless it
        # was started ignoring it (nohup): then it outlives the terminal.
        hup = main and signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
        before = signal.signal(signal.SIGHUP, self.handle_exit) if hup else None
        try:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()
        finally:
            if hup:
                signal.signal(signal.SIGHUP, before)
        # Cleanup is done and the process is on its way out: a repeated
        # SIGTERM (a supervisor that sends one per second) must not turn a
        # clean exit into a death by signal.
        if main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            # What startup made (the app, its routes and schemas, the modules)
            # lives as long as the broker.  Moved out of the collector's sight,
            # the collections that batches of many versions set off walk only
            # what requests made: over 150 handoffs of 1,000 tensors, 0.16 s
            # in the collector instead of 0.41 s.
            gc.collect()
            gc.freeze()
            # A batch makes a few objects per tensor before it frees the
            # versions it replaces: at the default 700, every 1,000-tensor
            # handoff set off two collections of the youngest generation
            # (0.35 ms of the broker's 4 ms).  Below this many, a batch
            # sets off none.
            gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
            log.info(self.ready_message)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        broker = getattr(getattr(self.config.app, "state", None), "broker", None)
        if broker is not None:
            broker.begin_shutdown()
        await super().shutdown(sockets=sockets)
        done = getattr(self.lifespan, "shutdown_event", None)
        if self.force_exit and done is not None and not done.is_set():
            # A second Ctrl-C skips uvicorn's waits for connections, and its
            # lifespan shutdown too, which would leave the lifespan to be
            # cancelled at exit (a traceback in the log); ours is quick and
            # unlinks every segment, so it runs.
            await self.lifespan.shutdown()
