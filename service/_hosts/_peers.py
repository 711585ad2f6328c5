"""Pull-through replicas: a get that misses here asks the peers over Arrow Flight.

    tensordepot serve --peer grpc://hostA:8815 [--peer ...] [--peer-refresh 1] [--peer-timeout 5]

On a miss, every peer is asked for the name at once (``GetFlightInfo``,
each bounded by ``--peer-timeout``).  The first peer in ``--peer`` order that
holds it names the lineage (the broker where it was published); among the
peers holding copies of that lineage, the newest version wins.  It is
streamed (``DoGet``) straight into an allocation in this broker's pool, made
in a session of the broker's own, and published as a local *replica* that
records its origin.  Every local worker then reads it zero copy: the bytes
cross the network once per host, not once per worker.

* Concurrent gets of one name share one lookup and one transfer (a future
  per name).
* A replica is served as it is for ``--peer-refresh`` seconds after a peer
  last confirmed it.  After that, the next get asks the peers again (one
  metadata call each) and fetches only a newer version.  If no peer can be
  reached, the replica is served as it is and a warning is logged; if every
  peer answers that the name is gone, the replica is deleted here too.
* A transfer that fails part way (the peer died, the network dropped, or no
  chunk came for ``--peer-timeout`` s) gives its allocation back: a partial
  replica is never visible, and the get raises ``BrokerUnavailable`` naming
  the peer.
* Requests carry the ids of the brokers they passed through
  (``x-tensordepot-via``); a broker that finds its own id there answers from
  its own memory only, so peers may point at each other, or chain.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import ValidationError

from ..._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorNotFound
from ..._wire import AllocRequest, FlightMeta, check_name
from ...shm._arrow import (
    AUTH_CODES,
    flight_code,
    flight_message,
    import_flight,
    meta_json,
    parse_flight_url,
    read_into,
)
from .._registry._broker import Broker
from .._registry._records import Replica, Version, check_item
from .._registry._sessions import LOCAL, Caller
from ._traffic import PEER_METRICS, Traffic

log = logging.getLogger("tensordepot.peers")

VIA: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("tensordepot_via", default=())
VIA_HEADER = "x-tensordepot-via"  # ids of the brokers a request passed through
PEER_HEADER = "x-tensordepot-peer"  # who is asking, for the other side's metrics
# bytes/s: a whole transfer's deadline is --peer-timeout plus nbytes at this rate
MIN_RATE = 1 << 20


@dataclass(frozen=True)
class _Found:
    peer: str
    meta: FlightMeta


class _Stale(DepotError):
    """The version a peer named is gone there by the time it is fetched."""

    def __init__(self, cause: DepotError) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class _Outcome:
    found: bool = False
    unreachable: dict[str, str] = field(default_factory=dict)  # peer -> why
    error: DepotError | None = None  # a transfer that failed


@dataclass(eq=False)
class _Transfer:
    peer: str
    last: float  # time.monotonic() of the last chunk
    reader: Any = None
    stalled: bool = False  # the watchdog cancelled it
    stopped: bool = False  # its get was cancelled: stop writing

    def stop(self) -> None:
        self.stopped = True
        if self.reader is not None:
            self.reader.cancel()


class Peers:
    """The peers of one broker; ``broker.peers`` is this object."""

    def __init__(
        self,
        broker: Broker,
        urls: list[str],
        *,
        token: str = "",
        refresh: float = 1.0,
        timeout: float = 5.0,
        tls_ca: bytes | None = None,
        instance: str = "",
        self_url: str = "",
    ) -> None:
        import_flight()
        self.broker = broker
        self.urls = [parse_flight_url(u, "--peer").url for u in urls]
        self.refresh = refresh
        self.timeout = timeout
        self.poll_interval = min(max(refresh, 0.2), 1.0)
        self.instance = instance
        self.traffic = Traffic()
        self._tls_ca = tls_ca
        self._headers: list[tuple[bytes, bytes]] = [
            (PEER_HEADER.encode(), (self_url or f"{socket.gethostname()}/{instance}").encode())
        ]
        if token:
            self._headers.append((b"authorization", b"Bearer " + token.encode()))
        # Metadata calls never queue behind transfers: each has its own threads.
        self._executor = ThreadPoolExecutor(
            max(4, 2 * len(self.urls)), thread_name_prefix="tensordepot-peer"
        )
        self._movers = ThreadPoolExecutor(4, thread_name_prefix="tensordepot-pull")
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._active: set[_Transfer] = set()
        self._inflight: dict[str, asyncio.Future[_Outcome]] = {}
        self._notes: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._closing = False
        self._watchdog: asyncio.Task[None] | None = None

    # -- the broker's hook ---------------------------------------------------------
    async def before_get(
        self, name: str, newer_than: int, can_wait: bool, caller: Caller = LOCAL
    ) -> None:
        if self._closing or self.instance in VIA.get():
            return  # shutting down, or the request came through us: our own memory only
        if self.local(name):
            return  # published or being written here: peers never shadow a local tensor
        e = self.broker.entries.get(name)
        held = e.ready if e is not None else None
        if (
            held is not None
            and held.replica is not None
            and self.broker.clock() - held.replica.checked_at < self.refresh
        ):
            return
        fut = self._inflight.get(name)
        if fut is None:
            fut = asyncio.ensure_future(self._refresh(name, caller))
            self._inflight[name] = fut
            fut.add_done_callback(
                lambda f: self._inflight.pop(name) if self._inflight.get(name) is f else None
            )
        outcome = await asyncio.shield(fut)
        if outcome.error is not None:
            raise type(outcome.error)(str(outcome.error))  # one instance per waiter
        if (
            not outcome.found
            and outcome.unreachable
            and not can_wait
            and len(outcome.unreachable) == len(self.urls)
        ):
            raise BrokerUnavailable(
                f"tensor {name!r} is not here and no peer could be asked: "
                f"{self._unreachable(outcome)}"
            )

    def explain(self, name: str) -> str:
        return self._notes.get(name, "")

    def local(self, name: str, but: Version | None = None) -> bool:
        """Whether ``name`` is this broker's own: published here, or being
        written here (by anything but a pull, and other than ``but``).  A
        local tensor always wins over a replica, even one pulled meanwhile."""
        e = self.broker.entries.get(name)
        if e is None:
            return False
        if e.ready is not None and e.ready.replica is None:
            return True
        return any(w.replica is None and w is not but for w in e.writing.values())

    # -- one lookup (and maybe one transfer) per name at a time ------------------------
    async def _refresh(self, name: str, caller: Caller) -> _Outcome:
        via = (*VIA.get(), self.instance)
        for _ in range(2):
            out = await self._refresh_once(name, via, caller)
            # A version superseded at the source between the lookup and the
            # transfer: look again.
            if not isinstance(out.error, _Stale):
                break
        if isinstance(out.error, _Stale):
            out.error = out.error.cause
        return out

    async def _refresh_once(self, name: str, via: tuple[str, ...], caller: Caller) -> _Outcome:
        answers = await asyncio.gather(
            *(self._run(self._ask, p, name, via) for p in self.urls), return_exceptions=True
        )
        found, out = [], _Outcome()
        for peer, a in zip(self.urls, answers, strict=True):
            if isinstance(a, FlightMeta):
                found.append(_Found(peer, a))
            elif isinstance(a, BaseException):
                out.unreachable[peer] = str(a)
        self._note(name, found, out)
        broker = self.broker
        e = broker.entries.get(name)
        held = e.ready if e is not None else None
        if self.local(name):
            out.found = True  # published, or being written, here meanwhile
            return out
        if not found:
            if held is not None and held.replica is not None:
                if out.unreachable:
                    log.warning(
                        "serving replica %r v%d as it is: %s",
                        name,
                        held.number,
                        self._unreachable(out),
                    )
                    held.replica.checked_at = broker.clock()
                    out.found = True  # there is something to serve
                else:
                    log.info("no peer holds %r any more; deleting its replica", name)
                    broker.delete(name)
            return out
        out.found = True
        first = found[0].meta.origin_instance
        best = max(
            (f for f in found if f.meta.origin_instance == first),
            key=lambda f: f.meta.origin_version,
        )
        if (
            held is not None
            and held.replica is not None
            and held.replica.instance == first
            and held.replica.version >= best.meta.origin_version
        ):
            held.replica.checked_at = broker.clock()  # still the newest
            return out
        try:
            await self._pull(best, via, caller)
        except TensorNotFound as exc:
            out.error = _Stale(exc)
        except DepotError as exc:
            if held is not None and held.replica is not None:
                log.warning("serving replica %r v%d as it is: %s", name, held.number, exc)
                held.replica.checked_at = broker.clock()
            else:
                out.error = exc
        return out

    def _note(self, name: str, found: list[_Found], out: _Outcome) -> None:
        if found:
            note = ""
        elif out.unreachable:
            note = f"; peers could not be asked: {self._unreachable(out)}"
        else:
            note = f"; no peer holds it either (asked {', '.join(self.urls)})"
        self._notes[name] = note
        self._notes.move_to_end(name)
        while len(self._notes) > 1024:
            self._notes.popitem(last=False)

    @staticmethod
    def _unreachable(out: _Outcome) -> str:
        return "; ".join(out.unreachable.values())

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _pull(self, f: _Found, via: tuple[str, ...], caller: Caller) -> None:
        """Copy ``f`` into a new allocation here and publish it as a replica.
        Until it is published nobody sees it; on any failure, ending the
        session gives the allocation back.  It is charged to the identity
        whose get caused it (``caller``), not to one the readers share."""
        broker, m = self.broker, f.meta
        who = Caller(caller.identity)
        sid = broker.own_session("peer-pull", who)
        try:
            v, _ = await broker.alloc(
                sid, who, AllocRequest(name=m.name, shape=m.shape, dtype=m.dtype)
            )
            # Set in the same step as the alloc: list() hides replicas in flight.
            v.replica = Replica(f.peer, m.origin, m.origin_instance, m.origin_version, 0.0)
            view = broker.view(v, writable=True)
            start = time.monotonic()
            t = _Transfer(f.peer, start)
            job = asyncio.get_running_loop().run_in_executor(
                self._movers, self._transfer, f, view, via, t
            )
            try:
                await asyncio.shield(job)
            except DepotError:
                self.traffic.add(f.peer, "failures", 1)
                raise
            finally:
                # cancelled: the allocation goes back only once nothing writes to it
                if not job.done():
                    t.stop()
                    await asyncio.wait({job})
            self.traffic.add(f.peer, "transfers", 1)
            self.traffic.add(f.peer, "seconds", time.monotonic() - start)
            if self.local(m.name, but=v):
                log.info(
                    "dropping the replica of %r from %s: it was written here meanwhile",
                    m.name,
                    f.peer,
                )
                return  # ending the session gives its memory back
            v.replica.checked_at = broker.clock()
            broker.publish(sid, who, m.name, v.number)
        finally:
            broker.end_local_session(sid)

    # -- Flight calls (executor threads) -------------------------------------------------
    def _client(self, peer: str) -> Any:
        fl = import_flight()
        with self._lock:
            c = self._clients.get(peer)
            if c is None:
                tls = peer.startswith("grpc+tls://")
                c = self._clients[peer] = fl.FlightClient(
                    peer, tls_root_certs=self._tls_ca if tls else None
                )
            return c

    def _options(self, via: tuple[str, ...], timeout: float | None) -> Any:
        fl = import_flight()
        headers = [*self._headers, (VIA_HEADER.encode(), ",".join(via).encode())]
        return fl.FlightCallOptions(timeout=timeout, headers=headers)

    def _ask(self, peer: str, name: str, via: tuple[str, ...]) -> FlightMeta | None:
        """The newest version ``peer`` holds of ``name``, or None."""
        import pyarrow as pa

        fl = import_flight()
        self.traffic.add(peer, "checks", 1)
        try:
            info = self._client(peer).get_flight_info(
                fl.FlightDescriptor.for_path(name), self._options(via, self.timeout)
            )
            meta = FlightMeta.model_validate_json(meta_json(info.schema))
            # The answer names what will be allocated and published here: the
            # one name check, and the name that was asked for, nothing else.
            check_name(meta.name, "the name in the answer")
            if meta.name != name:
                raise ValueError(f"it answered for {meta.name!r}")
            # And its geometry, through the one check of an allocation's.
            nbytes = check_item(meta.dtype, meta.shape)[3]
            if nbytes != meta.nbytes:
                raise ValueError(
                    f"it describes {name!r} as {meta.nbytes} bytes, but shape "
                    f"{meta.shape} of {meta.dtype} is {nbytes}"
                )
            return meta
        except (pa.ArrowException, ValueError) as exc:
            if flight_code(exc) == TensorNotFound.code:
                return None
            raise self._error(peer, exc, f"when asked for {name!r}") from None

    def _transfer(self, f: _Found, view: Any, via: tuple[str, ...], t: _Transfer) -> None:
        import pyarrow as pa

        fl = import_flight()
        m = f.meta
        what = f"while sending {m.name!r} v{m.version}"
        deadline = self.timeout + m.nbytes / MIN_RATE
        with self._lock:
            if t.stopped:
                raise BrokerUnavailable(f"the pull of {m.name!r} was cancelled")
            self._active.add(t)
        try:
            reader = self._client(f.peer).do_get(
                fl.Ticket(f"{m.name}@{m.version}".encode()), self._options(via, deadline)
            )
            t.last, t.reader = time.monotonic(), reader
            if t.stopped:
                reader.cancel()
            sent = FlightMeta.model_validate_json(meta_json(reader.schema))
            if sent != m:
                raise ValueError(f"the stream describes {sent}, not {m}")

            def progress(n: int) -> None:
                t.last = time.monotonic()
                self.traffic.add(f.peer, "bytes_pulled", n)

            got = read_into(reader, view, progress, lambda: self._closing or t.stopped)
            if got != m.nbytes:
                raise BrokerUnavailable(f"peer {f.peer} sent {got} of {m.nbytes} bytes {what}")
        except (pa.ArrowException, ValueError, InterruptedError) as exc:
            if t.stalled:
                raise BrokerUnavailable(
                    f"peer {f.peer} sent nothing for {self.timeout:g} s "
                    f"{what}; the partial copy was discarded"
                ) from None
            if isinstance(exc, fl.FlightTimedOutError) and not self._closing:
                raise BrokerUnavailable(
                    f"peer {f.peer} did not finish sending {m.name!r} v{m.version} within "
                    f"{deadline:g} s, the whole "
                    f"transfer's deadline (--peer-timeout plus 1 s per MiB); the partial copy "
                    f"was discarded"
                ) from None
            raise self._error(f.peer, exc, what, partial=True) from None
        finally:
            with self._lock:
                self._active.discard(t)

    def _error(self, peer: str, exc: Exception, what: str, partial: bool = False) -> DepotError:
        import pyarrow as pa

        fl = import_flight()
        msg, code = flight_message(exc), flight_code(exc)
        tail = "; the partial copy was discarded" if partial else ""
        if self._closing:
            return BrokerUnavailable("the broker is shutting down")
        if code == TensorNotFound.code:
            return TensorNotFound(f"peer {peer} {what}: {msg}")
        if code in AUTH_CODES:
            return BrokerUnavailable(
                f"peer {peer} refused this broker's token {what} ({msg}); check --peer-token"
            )
        if isinstance(exc, fl.FlightTimedOutError):
            return BrokerUnavailable(
                f"peer {peer} did not answer within {self.timeout:g} s {what}{tail}"
            )
        if isinstance(exc, InvalidRequest):
            return BrokerUnavailable(
                f"peer {peer} announced what this broker cannot hold {what}: {msg}"
            )
        if isinstance(exc, (ValidationError, ValueError)) and not isinstance(
            exc, pa.ArrowException
        ):
            return BrokerUnavailable(
                f"peer {peer} sent something that is not a tensordepot stream {what}: {msg}{tail}"
            )
        return BrokerUnavailable(f"peer {peer} failed {what}: {msg}{tail}")

    # -- lifetime -------------------------------------------------------------------------
    def start(self) -> None:
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Cancel transfers that have sent nothing for --peer-timeout seconds."""
        while True:
            await asyncio.sleep(min(self.timeout / 4, 1.0))
            now = time.monotonic()
            with self._lock:
                stalled = [
                    t for t in self._active if t.reader is not None and now - t.last > self.timeout
                ]
            for t in stalled:
                t.stalled = True
                t.stop()

    async def close(self) -> None:
        """Stop: transfers in flight fail (their allocations are given back)."""
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        with self._lock:
            for t in self._active:
                t.stop()
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        for pool in (self._executor, self._movers):
            await asyncio.to_thread(pool.shutdown, wait=True)
        for c in self._clients.values():
            c.close()

    def collect(self) -> Iterator[Metric]:
        """The replicas held here and the traffic with each peer (a
        prometheus_client collector, registered in the app's registry)."""
        replicas = [
            e._ready  # a replica is a Version, never a pack's row
            for e in self.broker.entries.values()
            if e._ready is not None and e._ready.replica is not None
        ]
        yield GaugeMetricFamily(
            "tensordepot_replicas",
            "Tensors held here as replicas pulled from peers.",
            value=len(replicas),
        )
        yield GaugeMetricFamily(
            "tensordepot_replica_bytes",
            "Bytes of the replicas held here.",
            value=sum(v.nbytes for v in replicas),
        )
        yield from self.traffic.families(PEER_METRICS)
