"""Serving tensors to brokers and clients on other hosts over Arrow Flight.

    tensordepot serve --flight grpc://0.0.0.0:8815 [--flight-tls-cert C --flight-tls-key K]

* ``GetFlightInfo`` of path ``[name]``: the newest version's shape, dtype,
  version and nbytes (``FlightMeta`` as JSON in the schema metadata), and one
  endpoint whose ticket is ``name@version``.
* ``DoGet`` of ``name`` or ``name@version`` (the part after the last ``@``,
  when it is all digits, is a version, which must still be the newest)
  streams the bytes as a ``uint8`` column in chunks of a few MiB, straight
  from the broker's own mapping of the segment.
* ``ListFlights``: every published tensor the token may read (the criteria,
  if any, is a name prefix).
* ``DoPut`` of path ``[name]``: a producer on another host pushes a tensor;
  it is allocated, filled from the stream and published here.

Threads: pyarrow runs every call on a gRPC thread, and the broker's state
lives on the event loop, unlocked.  So each broker call is marshalled onto
the loop (``run_coroutine_threadsafe``) and the Flight thread only moves
bytes.  A stream holds a lease on the version it sends, in a session of its
own, from before the first byte until the stream ends or is dropped, so a
delete or supersede during a transfer never frees bytes still being sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from prometheus_client.core import Metric
from pydantic import ValidationError

from ..._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorNotFound
from ..._wire import AllocRequest, FlightMeta, check_name, is_name
from ...shm import array_at
from ...shm._arrow import (
    FlightURL,
    batches,
    flight_message,
    import_flight,
    meta_json,
    parse_flight_url,
    read_into,
    schema,
    to_flight,
)
from .._auth import AuthPolicy
from .._registry._broker import Broker
from .._registry._records import Version
from .._registry._sessions import LOCAL, Caller
from ..config import ListenError
from ._peers import PEER_HEADER, VIA, VIA_HEADER
from ._scopes import Scopes
from ._traffic import PeerMetric, Traffic

log = logging.getLogger("tensordepot.flight")
T = TypeVar("T")

FLIGHT_METRICS = (
    PeerMetric(
        "tensordepot_flight_bytes_served",
        "Bytes streamed to each peer or client (DoGet).",
        "bytes_served",
    ),
    PeerMetric(
        "tensordepot_flight_streams_served",
        "Streams (DoGet) started for each peer or client.",
        "streams_served",
    ),
    PeerMetric(
        "tensordepot_flight_bytes_pushed",
        "Bytes pushed here by each peer or client (DoPut).",
        "bytes_pushed",
    ),
    PeerMetric(
        "tensordepot_flight_pushes",
        "Tensors pushed here and published, per peer or client.",
        "pushes",
    ),
)


def parse_ticket(raw: bytes) -> tuple[str, int | None]:
    """``name`` or ``name@version`` -> (name, version or None); ValueError if malformed."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("bad ticket: expected ASCII 'name' or 'name@version'") from None
    name, version = text, None
    head, sep, tail = text.rpartition("@")
    if sep and tail.isdigit() and head:
        name, version = head, int(tail)
    if not is_name(name):
        raise ValueError(
            f"bad ticket {text[:80]!r}: expected 'name' or 'name@version' "
            f"(names are 1-512 printable ASCII characters without spaces)"
        )
    if version is not None and version < 1:
        raise ValueError(f"bad ticket {text[:80]!r}: versions start at 1")
    return name, version


def descriptor_name(descriptor: Any) -> str:
    """The tensor name a descriptor's one-element path holds, through the one
    name check (``check_name``); a ticket's ``@version`` has no place here, so
    ``w@3`` names the tensor ``w@3``."""
    fl = import_flight()
    path = descriptor.path if descriptor.descriptor_type == fl.DescriptorType.PATH else None
    if not path or len(path) != 1:
        raise ValueError(
            "bad descriptor: give the tensor's name as a one-element path "
            "(FlightDescriptor.for_path(name))"
        )
    raw = path[0]
    try:
        name = raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise InvalidRequest(f"bad descriptor {raw[:80]!r}: a tensor name is ASCII") from None
    return check_name(name, "descriptor name")


def meta_of(v: Version, self_url: str, instance: str) -> FlightMeta:
    r = v.replica
    return FlightMeta(
        name=v.name,
        version=v.number,
        shape=list(v.shape),
        dtype=v.dtype,
        nbytes=v.nbytes,
        origin=r.origin if r else self_url,
        origin_instance=r.instance if r else instance,
        origin_version=r.version if r else v.number,
    )


def _translated(fn: Callable[..., T]) -> Callable[..., T]:
    """Flight handlers raise Flight's errors, never ours, and never one that
    would carry a traceback to the caller (``shm/_arrow.py``, ``to_flight``)."""

    def wrapper(*args: Any, **kw: Any) -> T:
        fl = import_flight()
        try:
            return fn(*args, **kw)
        except fl.FlightError:
            raise  # pyarrow's own, or one of ours: a message and a code, no traceback
        except DepotError as exc:
            raise to_flight(exc) from None
        except ValueError as exc:  # a bad ticket, descriptor or stream (pyarrow's ArrowInvalid)
            raise to_flight(InvalidRequest(flight_message(exc))) from None
        except Exception:
            log.exception("Flight %s failed", fn.__name__)
            raise fl.FlightInternalError(
                "the broker failed to answer; its log has the details", b"internal"
            ) from None

    wrapper.__name__ = fn.__name__
    return wrapper


@dataclass(frozen=True)
class _Call:
    token: str | None
    via: tuple[str, ...]
    peer: str  # who is calling, for the per-peer metrics


def _header(headers: dict[str, list[Any]], key: str) -> str | None:
    values = headers.get(key)
    if not values:
        return None
    v = values[0]
    return v.decode("latin-1") if isinstance(v, bytes) else str(v)


def _peer_label(call_peer: str, declared: str | None) -> str:
    if declared:
        return declared[:200]
    # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555": the address without the port.
    addr = call_peer.split(":", 1)[-1]
    return addr.rsplit(":", 1)[0].strip("[]") or "unknown"


class FlightService:
    """The Flight endpoint of one broker.  Built (and listening) before the
    broker starts, so a bad address fails the command; ``attach`` connects it
    to the broker once the event loop runs.  Until then calls get UNAVAILABLE."""

    def __init__(
        self, url: FlightURL, scopes: Scopes, *, tls: tuple[bytes, bytes] | None = None
    ) -> None:
        fl = import_flight()
        factory_base: Any = fl.ServerMiddlewareFactory
        middleware_base: Any = fl.ServerMiddleware
        server_base: Any = fl.FlightServerBase
        self.scopes = scopes
        self.traffic = Traffic()
        self._broker: Broker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._shut = False
        self._shutdown_lock = threading.Lock()
        self._pid = os.getpid()
        self.instance = ""
        service = self

        class _Auth(factory_base):  # type: ignore[misc]
            def start_call(self, info: Any, headers: dict[str, list[Any]]) -> Any:
                auth = _header(headers, "authorization") or ""
                scheme, _, token = auth.partition(" ")
                tok = token.strip() if scheme.lower() == "bearer" else None
                if not scopes.known(tok):
                    raise fl.FlightUnauthenticatedError(
                        "missing or unknown token: send 'authorization: Bearer <token>'",
                        b"unauthorized",
                    )
                via = tuple(x for x in (_header(headers, VIA_HEADER) or "").split(",") if x)
                return _Middleware(tok, via, _header(headers, PEER_HEADER))

        class _Middleware(middleware_base):  # type: ignore[misc]
            def __init__(self, token: str | None, via: tuple[str, ...], peer: str | None) -> None:
                self.token, self.via, self.peer = token, via, peer

        class _Server(server_base):  # type: ignore[misc]
            @_translated
            def get_flight_info(self, context: Any, descriptor: Any) -> Any:
                return service.get_flight_info(service.call(context), descriptor)

            @_translated
            def do_get(self, context: Any, ticket: Any) -> Any:
                return service.do_get(service.call(context), ticket.ticket)

            @_translated
            def list_flights(self, context: Any, criteria: bytes) -> Iterator[Any]:
                return service.list_flights(service.call(context), criteria)

            @_translated
            def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
                service.do_put(service.call(context), descriptor, reader, writer)

        import pyarrow as pa

        certs = [fl.CertKeyPair(cert=tls[0], key=tls[1])] if tls else None
        try:
            self._server = _Server(
                url.location(), tls_certificates=certs, middleware={"auth": _Auth()}
            )
        except (pa.ArrowException, OSError) as exc:
            raise ListenError(
                f"--flight {url.url}: cannot listen: {str(exc).splitlines()[0]}"
            ) from None
        self.url = url.location(self._server.port)
        # What other brokers call this one in a replica's origin.
        host = socket.gethostname() if url.host in ("0.0.0.0", "::") else url.host
        self.self_url = FlightURL(url.url, host, self._server.port, url.tls).location()

    # -- wiring ---------------------------------------------------------------
    def attach(self, broker: Broker, loop: asyncio.AbstractEventLoop, instance: str) -> None:
        self._broker, self._loop, self.instance = broker, loop, instance

    async def close(self) -> None:
        """Stop serving: streams end at their next chunk, then the server shuts
        down (off the event loop: shutdown waits for calls, which need it)."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop serving and wait for calls in progress.  Idempotent; never on the event loop."""
        self._closing = True
        with self._shutdown_lock:
            if not self._shut:
                self._shut = True
                self._server.shutdown()

    def collect(self) -> Iterator[Metric]:
        """The traffic with each peer or client (a prometheus_client
        collector, registered in the app's registry)."""
        yield from self.traffic.families(FLIGHT_METRICS)

    def call(self, context: Any) -> _Call:
        mw = context.get_middleware("auth")
        return _Call(mw.token, mw.via, _peer_label(context.peer(), mw.peer))

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or self._closing:
            coro.close()
            raise BrokerUnavailable("the broker is starting or shutting down; retry")
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:  # not the builtin one before Python 3.11
                if self._closing or loop.is_closed():
                    fut.cancel()
                    raise BrokerUnavailable("the broker is shutting down") from None

    def _release_later(self, sid: str) -> None:
        """End a stream's session (and so its lease) from any thread."""
        loop, broker = self._loop, self._broker
        if loop is None or broker is None:
            return
        try:
            loop.call_soon_threadsafe(broker.end_local_session, sid)
        except RuntimeError:
            pass  # the loop is closed: the broker and its leases are gone

    # -- broker calls (on the event loop) ----------------------------------------
    async def _lookup(
        self, name: str, version: int | None, via: tuple[str, ...], keep: bool, prefix: str | None
    ) -> tuple[str, FlightMeta, Any]:
        """Lease the newest version of ``name`` (exactly ``version`` if given)
        in a session of its own.  A miss may pull from this broker's peers,
        unless the request came through this broker already; its message
        names only names starting with the caller's ``prefix``."""
        broker = self._broker
        assert broker is not None
        sid = broker.own_session("flight")
        reset = VIA.set(via)
        try:
            v, _ = await broker.get(sid, replace(LOCAL, prefix=prefix), name, 0)
            if version is not None and v.number != version:
                raise TensorNotFound(
                    f"version {version} of {name!r} is not the newest (that is "
                    f"{v.number}); ask GetFlightInfo for the current ticket"
                )
            meta = meta_of(v, self.self_url, self.instance)
            view = broker.view(v) if keep else None
        except BaseException:
            broker.end_local_session(sid)
            raise
        finally:
            VIA.reset(reset)
        if not keep:
            broker.end_local_session(sid)
        return sid, meta, view

    async def _listing(self, prefix: str) -> list[FlightMeta]:
        broker = self._broker
        assert broker is not None
        return [
            meta_of(v, self.self_url, self.instance)
            for n, e in sorted(broker.entries.items())
            if n.startswith(prefix) and (v := e.facts()) is not None
        ]

    async def _alloc(self, who: Caller, req: AllocRequest) -> tuple[str, Version, Any]:
        """Allocate a push in a session of the broker's own that belongs to
        ``who``: its bytes are charged to the pushing token's quotas, as an
        HTTP put's are (``_quotas``)."""
        broker = self._broker
        assert broker is not None
        sid = broker.own_session("flight-put", who)
        try:
            v, _ = await broker.alloc(sid, who, req)
            return sid, v, broker.view(v, writable=True)
        except BaseException:
            broker.end_local_session(sid)
            raise

    async def _publish(self, who: Caller, sid: str, name: str, number: int) -> int:
        broker = self._broker
        assert broker is not None
        return broker.publish(sid, who, name, number).number

    # -- handlers (on gRPC threads) ------------------------------------------------
    def _info(self, meta: FlightMeta, descriptor: Any) -> Any:
        fl = import_flight()
        ticket = fl.Ticket(f"{meta.name}@{meta.version}".encode())
        return fl.FlightInfo(
            schema(meta.model_dump_json()),
            descriptor,
            [fl.FlightEndpoint(ticket, [])],
            total_records=meta.nbytes,
            total_bytes=meta.nbytes,
        )

    def get_flight_info(self, call: _Call, descriptor: Any) -> Any:
        name = descriptor_name(descriptor)
        self.scopes.authorize(call.token, "read", name)
        _, meta, _ = self._on_loop(
            self._lookup(name, None, call.via, keep=False, prefix=self.scopes.prefix(call.token))
        )
        return self._info(meta, descriptor)

    def list_flights(self, call: _Call, criteria: bytes) -> Iterator[Any]:
        fl = import_flight()
        prefix = criteria.decode("ascii", errors="replace") if criteria else ""
        for meta in self._on_loop(self._listing(prefix)):
            if self.scopes.allows(call.token, "read", meta.name):
                yield self._info(meta, fl.FlightDescriptor.for_path(meta.name))

    def do_get(self, call: _Call, raw_ticket: bytes) -> Any:
        fl = import_flight()
        name, version = parse_ticket(raw_ticket)
        self.scopes.authorize(call.token, "read", name)
        sid, meta, view = self._on_loop(
            self._lookup(name, version, call.via, keep=True, prefix=self.scopes.prefix(call.token))
        )
        lease = _StreamLease(self, sid)  # from here on, dropping it ends the lease
        # The lease ends when the last Arrow buffer over these bytes is freed:
        # gRPC may still hold the last chunks after the stream's generator ends.
        leased = array_at(
            view.ctypes.data, (len(view),), None, "|u1", writable=False, owner=(view, lease)
        )
        sch = schema(meta.model_dump_json())
        return fl.GeneratorStream(sch, self._stream(leased, sch, call.peer))

    def _stream(self, view: Any, sch: Any, peer: str) -> Iterator[Any]:
        fl = import_flight()
        self.traffic.add(peer, "streams_served", 1)
        for batch in batches(view, sch):
            if self._closing:
                raise fl.FlightUnavailableError(
                    "the broker is shutting down; retry", b"broker_unavailable"
                )
            yield batch
            self.traffic.add(peer, "bytes_served", batch.num_rows)

    def do_put(self, call: _Call, descriptor: Any, reader: Any, writer: Any) -> None:
        import pyarrow as pa

        name = descriptor_name(descriptor)
        self.scopes.authorize(call.token, "write", name)
        try:
            meta = FlightMeta.model_validate_json(meta_json(reader.schema))
            req = AllocRequest(name=name, shape=meta.shape, dtype=meta.dtype)
        except ValidationError as exc:
            raise InvalidRequest(
                f"bad tensordepot metadata for {name!r}: {str(exc).splitlines()[0]}"
            ) from None
        who = self.scopes.caller(call.token)
        sid, v, view = self._on_loop(self._alloc(who, req))
        try:  # ending the session gives the allocation back unless it was published
            if v.nbytes != meta.nbytes:
                raise InvalidRequest(
                    f"metadata says {meta.nbytes} bytes, but shape {meta.shape} "
                    f"of {meta.dtype} is {v.nbytes}"
                )
            got = read_into(
                reader,
                view,
                lambda n: self.traffic.add(call.peer, "bytes_pushed", n),
                lambda: self._closing,
            )
            if got != v.nbytes:
                raise InvalidRequest(f"the stream carried {got} bytes; {name!r} needs {v.nbytes}")
            number = self._on_loop(self._publish(who, sid, name, v.number))
            self.traffic.add(call.peer, "pushes", 1)
            writer.write(pa.py_buffer(json.dumps({"name": name, "version": number}).encode()))
        finally:
            self._release_later(sid)


class _StreamLease:
    """Ends a stream's session (and so its lease) when it is garbage: when the
    stream and every buffer gRPC holds over its bytes are gone, in whatever
    thread drops the last one."""

    def __init__(self, service: FlightService, sid: str) -> None:
        weakref.finalize(self, service._release_later, sid)


def bind_flight(settings: Any, policy: AuthPolicy) -> FlightService:
    """Build the Flight endpoint of ``settings`` (listening), or ListenError.
    It takes the broker's own tokens and scopes (``policy``)."""
    try:
        import_flight()
    except ImportError as exc:
        raise ListenError(f"--flight: {exc}") from None
    try:
        url = parse_flight_url(settings.flight)
    except ValueError as exc:
        raise ListenError(str(exc)) from None
    scopes = Scopes.of(policy)
    if not scopes.enabled and not policy.insecure_no_auth:
        raise ListenError(
            f"--flight {url.url} needs a token, as every TCP listener does (other "
            "local users can reach loopback): give --token-file or "
            "TENSORDEPOT_TOKEN, or --insecure-no-auth"
        )
    tls = None
    if url.tls:
        if not (settings.flight_tls_cert and settings.flight_tls_key):
            raise ListenError(f"--flight {url.url} needs --flight-tls-cert and --flight-tls-key")
        try:
            with (
                open(settings.flight_tls_cert, "rb") as c,
                open(settings.flight_tls_key, "rb") as k,
            ):
                tls = (c.read(), k.read())
        except OSError as exc:
            raise ListenError(f"--flight-tls-cert/--flight-tls-key: {exc}") from None
    elif settings.flight_tls_cert or settings.flight_tls_key:
        raise ListenError("--flight-tls-cert/--flight-tls-key need a grpc+tls:// --flight URL")
    return FlightService(url, scopes, tls=tls)
