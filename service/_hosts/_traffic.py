"""Traffic with other brokers: counts per remote broker, for the metrics.

``Traffic`` is updated from any thread (the Flight transfers, the Flight
service's calls) and read when Prometheus scrapes; the transfers never touch
prometheus_client.  ``PEER_METRICS`` are the pulling side's families (the
Flight service declares its own).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily


@dataclass(frozen=True)
class PeerMetric:
    """One metric family with a ``peer`` label, read from ``Traffic``: a
    counter of ``key``, or, given ``count``, a summary whose sum is ``key``
    and whose count is ``count``."""

    name: str
    help: str
    key: str
    count: str = ""


class Traffic:
    """Counts per remote broker, updated from any thread, exported by
    ``families`` when Prometheus scrapes (the transfers never touch
    prometheus_client).  The number of remotes counted is bounded; the rest
    are counted as ``other``."""

    LIMIT = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_peer: dict[str, dict[str, float]] = {}

    def add(self, peer: str, key: str, n: float) -> None:
        with self._lock:
            d = self.by_peer.get(peer)
            if d is None:
                if len(self.by_peer) >= self.LIMIT:
                    peer = "other"
                d = self.by_peer.setdefault(peer, {})
            d[key] = d.get(key, 0) + n

    def families(self, metrics: Iterable[PeerMetric]) -> Iterator[Metric]:
        """One family per metric, one sample per peer (prometheus_client
        writes the text, escaping the label values)."""
        with self._lock:
            snap = {p: dict(d) for p, d in self.by_peer.items()}
        for m in metrics:
            family: CounterMetricFamily | SummaryMetricFamily
            if m.count:
                family = SummaryMetricFamily(m.name, m.help, labels=["peer"])
                for peer in sorted(snap):
                    family.add_metric(
                        [peer],
                        count_value=int(snap[peer].get(m.count, 0)),
                        sum_value=snap[peer].get(m.key, 0),
                    )
            else:
                family = CounterMetricFamily(m.name, m.help, labels=["peer"])
                for peer in sorted(snap):
                    family.add_metric([peer], snap[peer].get(m.key, 0))
            yield family


PEER_METRICS = (
    PeerMetric(
        "tensordepot_peer_bytes_pulled",
        "Bytes received from each peer (failed transfers included).",
        "bytes_pulled",
    ),
    PeerMetric("tensordepot_peer_transfers", "Replicas pulled from each peer.", "transfers"),
    PeerMetric(
        "tensordepot_peer_transfer_failures",
        "Transfers from each peer that failed part way.",
        "failures",
    ),
    PeerMetric("tensordepot_peer_checks", "Metadata calls (GetFlightInfo) to each peer.", "checks"),
    PeerMetric(
        "tensordepot_peer_transfer_seconds",
        "Duration of the completed transfers from each peer.",
        "seconds",
        count="transfers",
    ),
)
