"""Wiring a broker to other hosts: its Flight endpoint (``--flight``) and its
peers (``--peer``).  Imported only when one of them is configured, so a
broker without them never imports pyarrow."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._broker import Broker
from .config import Settings


@dataclass
class Hosts:
    flight: Any = None  # FlightService
    peers: Any = None  # Peers
    metric_sources: list[Callable[[], list[str]]] = field(default_factory=list)

    async def close(self) -> None:
        """Stop both; transfers in flight fail and give their allocations back."""
        if self.peers is not None:
            await self.peers.close()
        if self.flight is not None:
            await self.flight.close()


def connect(settings: Settings, broker: Broker, flight: Any = None) -> Hosts:
    """Attach ``flight`` (bound by the CLI, or bound here) and start the peers.
    Call on the event loop."""
    from ._flight import bind_flight
    from ._peers import Peers

    hosts = Hosts()
    instance = secrets.token_hex(8)  # this run's id: version numbers restart with a broker
    if flight is None and settings.flight:
        flight = bind_flight(settings)
    if flight is not None:
        flight.attach(broker, asyncio.get_running_loop(), instance)
        hosts.flight = flight
        hosts.metric_sources.append(flight.metric_lines)
    if settings.peer:
        ca = None
        if settings.peer_tls_ca:
            with open(settings.peer_tls_ca, "rb") as f:
                ca = f.read()
        peers = Peers(broker, settings.peer, token=settings.peer_token or settings.token,
                      refresh=settings.peer_refresh, timeout=settings.peer_timeout, tls_ca=ca,
                      instance=instance, self_url=flight.self_url if flight is not None else "")
        peers.start()
        broker.peers = peers
        hosts.peers = peers
        hosts.metric_sources.append(peers.metric_lines)
    return hosts
