"""Wiring a broker to other hosts: its Flight endpoint (``--flight``) and its
peers (``--peer``).  Imported only when one of them is configured, so a
broker without them never imports pyarrow."""

from __future__ import annotations

import asyncio
import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from .._auth import AuthPolicy
from .._metrics import Metrics
from .._registry._broker import Broker
from ..config import Settings

log = logging.getLogger("tensordepot.broker")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_receive_buffers_warm(nbytes: int = 64 << 20) -> None:
    """Let glibc reuse freed blocks of up to ``nbytes`` instead of unmapping them.

    glibc serves large allocations with mmap and returns them with munmap on
    free, so every message gRPC receives lands in fresh pages that the kernel
    must zero and fault in: a quarter of the receiving broker's CPU during a
    pull (perf: clear_page_erms, exc_page_fault).  With a fixed mmap threshold
    above the message size, and a trim threshold that keeps a few messages'
    worth of free heap, the next message reuses warm pages."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc
        return
    if not (mallopt(_M_MMAP_THRESHOLD, nbytes) and mallopt(_M_TRIM_THRESHOLD, 4 * nbytes)):
        log.debug("mallopt refused; gRPC receive buffers stay on fresh pages")


@dataclass
class Hosts:
    metrics: Metrics | None = None
    flight: Any = None  # FlightService
    peers: Any = None  # Peers

    def _export(self, collector: Any) -> None:
        if self.metrics is not None:
            self.metrics.add(collector)

    async def close(self) -> None:
        """Stop both; transfers in flight fail and give their allocations back.
        Their metrics leave the app's registry."""
        for part in (self.peers, self.flight):
            if part is not None and self.metrics is not None:
                self.metrics.remove(part)
        if self.peers is not None:
            await self.peers.close()
        if self.flight is not None:
            await self.flight.close()


def connect(
    settings: Settings,
    broker: Broker,
    policy: AuthPolicy,
    flight: Any = None,
    metrics: Metrics | None = None,
) -> Hosts:
    """Attach ``flight`` (bound by the CLI, or bound here on ``policy``: the
    broker's own tokens and scopes) and start the peers; both export their
    metrics through ``metrics`` (the app's registry).  Call on the event loop."""
    from ._flight import bind_flight
    from ._peers import Peers

    hosts = Hosts(metrics)
    keep_receive_buffers_warm()
    instance = broker.instance
    if flight is None and settings.flight:
        flight = bind_flight(settings, policy)
    if flight is not None:
        flight.attach(broker, asyncio.get_running_loop(), instance)
        hosts.flight = flight
        hosts._export(flight)
    if settings.peer:
        ca = None
        if settings.peer_tls_ca:
            with open(settings.peer_tls_ca, "rb") as f:
                ca = f.read()
        peers = Peers(
            broker,
            settings.peer,
            token=settings.peer_token or settings.token,
            refresh=settings.peer_refresh,
            timeout=settings.peer_timeout,
            tls_ca=ca,
            instance=instance,
            self_url=flight.self_url if flight is not None else "",
        )
        peers.start()
        broker.peers = peers
        hosts.peers = peers
        hosts._export(peers)
    return hosts
