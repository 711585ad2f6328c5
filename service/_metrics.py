"""Prometheus metrics for ``GET /metrics``, one registry per app.

Each app owns a ``CollectorRegistry`` of its own (never prometheus_client's
global default), so several brokers in one process (tests, embedding) do
not clash.  Two sources fill it:

* ``Metrics.observe_route``, which the gate (service/_http/_gate.py) calls for
  each HTTP request at either door, refused ones included, labelled with
  the method, the *template* of the route the path matches
  (``/v1/tensors/{name}``, never the raw path, so tensor names cannot
  multiply series) and the status.
* ``BrokerCollector`` reads the broker at scrape time: its plain event
  counters (``Broker.counters``) and its memory and lifetime accounting,
  shared memory as ``device="cpu"`` and each GPU in use as
  ``device="cuda:GPU-<uuid>"``.  Nothing on the broker's hot paths touches
  prometheus_client.
* ``Metrics.add`` registers more collectors for as long as they run: the
  Flight endpoint (``FlightService``) and the peers (``Peers``), whose
  per-peer traffic is read the same way, at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._version import __version__
from .._wire import DeviceStat

if TYPE_CHECKING:
    from ._registry._broker import Broker

Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)

CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED = "unmatched"  # the route label of a path no route serves (a 404)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

# Control-plane requests take about a millisecond; a get may wait up to its timeout.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# Broker.counters key -> HELP.  A key missing here is still exported, with a generic HELP.
COUNTERS = {
    "allocs": "Tensor versions allocated (put, empty, put_many).",
    "publishes": "Tensor versions published.",
    "links": "Versions published by sharing another tensor's bytes, without a copy.",
    "gets": "Tensors handed out by get and get_many (a get_many's tensors of one pack share "
    "one lease).",
    "waits": "Gets that had to wait for a publish.",
    "releases": "Leases released.",
    "deletes": "Names deleted, by delete or by their ttl running out.",
    "expired": "Names deleted because their ttl ran out.",
    "sessions_opened": "Client sessions opened.",
    "sessions_ended": "Client sessions ended: closed, reaped, or at shutdown.",
    "sessions_reaped": "Sessions reclaimed because their process died without ending them (a "
    "crash, kill -9) or their heartbeats stopped.",
    "sessions_exited": "Sessions whose process exited normally with views still alive (its "
    "client said so on the way out), ended once it was gone: not crashes.",
    "writes_reclaimed": "Unpublished versions reclaimed: their writer's session ended, they were "
    "aborted, or their batch failed.",
    "quota_refusals": "Allocations refused with 507: --max-memory, /dev/shm, or a per-session "
    "or per-token quota was full.",
    "sessions_lapsed": "Sessions ended because their heartbeats stopped: their memory is retired "
    "until the process says its views are gone, or --lapse-grace.",
    "allocs_expired": "Unpublished versions reclaimed after --alloc-ttl; their memory is retired "
    "until the writer's views are gone.",
    "forks": "Sessions made for forked children, holding copies of their parent's leases.",
    "lease_refusals": "Gets refused with 429: the session held --max-leases-per-session leases.",
    "replicas_evicted": "Replicas pulled from peers that no lease held, dropped for room (a "
    "cache: a later get pulls them again).",
}
# Counters of bytes, labelled with the device that holds them.
BYTE_COUNTERS = {
    "bytes_put": "Bytes of tensor versions published (a shared, uncopied version counts too).",
    "bytes_got": "Bytes of tensor versions leased by get and get_many.",
}
DEVICE = "cpu"  # the device label of shared memory; a GPU's is its DeviceStat.device

_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Metrics:
    """An app's registry, its request histogram, and the broker collector."""

    def __init__(self, broker: Callable[[], Broker | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "tensordepot_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by method, route "
            "template and status; a get that waits for a publish counts its wait.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self._children: dict[tuple[str, str, int], Any] = {}
        self.registry.register(BrokerCollector(broker))
        self.collectors: list[Collector] = []  # added with add(), in order

    def add(self, collector: Collector) -> None:
        """Export ``collector``'s metrics too, until ``remove``."""
        self.registry.register(collector)
        self.collectors.append(collector)

    def remove(self, collector: Collector) -> None:
        self.registry.unregister(collector)
        self.collectors.remove(collector)

    def observe_route(self, method: str, template: str, status: int, seconds: float) -> None:
        """Time one request: its method, its route's template (never the raw
        path, so tensor names cannot multiply series) and its status."""
        if method not in METHODS:  # clients may send any word as a method
            method = "other"
        key = (method, template, status)
        child = self._children.get(key)
        if child is None:  # labels() costs more than observe(): keep each child
            child = self._children[key] = self.latency.labels(key[0], key[1], str(status))
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BrokerCollector(Collector):
    """The broker's counters and accounting, read when Prometheus scrapes.

    ``broker`` returns the live broker, or None before the lifespan has made
    one (then only the request histogram is exported)."""

    def __init__(self, broker: Callable[[], Broker | None]) -> None:
        self._broker = broker

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "tensordepot_build_info", "The broker's version; always 1.", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        broker = self._broker()
        if broker is None:
            return
        counters = dict(broker.counters)
        for key, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"tensordepot_{key}", help_text, value=counters.pop(key, 0))
        for key, help_text in BYTE_COUNTERS.items():
            yield _per_device(
                CounterMetricFamily(f"tensordepot_{key}", help_text, labels=["device"]),
                counters.pop(key, 0),
            )
        for key, value in sorted(counters.items()):  # counted by the broker, not described here
            name = _NOT_A_NAME.sub("_", key)
            yield CounterMetricFamily(
                f"tensordepot_{name}", f"Broker events counted as {key!r}.", value=value
            )

        st = broker.stat()
        # Memory gauges by device: name, HELP, shared memory's value, and how to
        # read a GPU's from its DeviceStat (None: shared memory only).  A GPU's
        # warm free space is what its pool holds beyond the blocks in use and
        # the freed ones still waiting for readers' kernels.
        memory: tuple[tuple[str, str, int, Callable[[DeviceStat], int] | None], ...] = (
            # Stat.bytes_in_use counts tensors on every device: shared memory's
            # share is what its pool's blocks hold.
            (
                "memory_in_use_bytes",
                "Bytes of the blocks that tensor versions hold (sizes rounded up to the block "
                "alignment), pending deletes included.",
                broker.pool.used,
                lambda d: d.bytes_in_use,
            ),
            (
                "memory_reserved_bytes",
                "Memory the broker holds in segments (shared memory) or blocks (a GPU), warm free "
                "space included.",
                st.bytes_reserved,
                lambda d: d.bytes_reserved,
            ),
            (
                "memory_warm_free_bytes",
                "Reserved memory that no tensor uses, kept warm for reuse.",
                broker.pool.warm_free(),
                lambda d: max(0, d.bytes_reserved - d.bytes_in_use - d.bytes_pending),
            ),
            (
                "memory_limit_bytes",
                "The most memory the broker may hold: --max-memory, or a GPU's --cuda-memory.",
                st.max_memory,
                lambda d: d.max_memory,
            ),
            (
                "memory_retired_bytes",
                (
                    "Bytes never to be reused, because a process the broker cannot vouch "
                    "for may still map them; freed with their segment."
                ),
                st.bytes_retired,
                None,
            ),
            (
                "segments",
                "Shared-memory segments, or a GPU's blocks, the broker holds.",
                st.segments,
                lambda d: d.segments,
            ),
        )
        for name, help_text, value, of_gpu in memory:
            family = _per_device(
                GaugeMetricFamily(f"tensordepot_{name}", help_text, labels=["device"]), value
            )
            if of_gpu is not None:
                for d in st.devices:
                    family.add_metric([d.device], of_gpu(d))
            yield family
        for name, help_text, field in (
            (
                "cuda_pending_bytes",
                "GPU memory freed but not yet reusable: readers' kernels may "
                "still read it (their release events have not completed).",
                "bytes_pending",
            ),
            (
                "cuda_shared_bytes",
                "Producer-owned GPU memory published with share(); the broker holds none of it.",
                "bytes_shared",
            ),
            (
                "cuda_context_bytes",
                "GPU memory the broker's CUDA context took, measured when it "
                "was created (absent when unknown).",
                "context_bytes",
            ),
            ("cuda_events", "Interprocess events the broker created on a GPU.", "events"),
        ):
            family = GaugeMetricFamily(f"tensordepot_{name}", help_text, labels=["device"])
            for d in st.devices:
                value = getattr(d, field)
                if value is not None:
                    family.add_metric([d.device], value)
            yield family
        for name, help_text, value in (
            ("tensors", "Names with a published version.", st.tensors),
            (
                "versions",
                "Tensor versions holding memory: being written, current, or still read.",
                st.versions,
            ),
            ("leases", "Leases held by readers.", st.leases),
            ("sessions", "Open client sessions.", st.sessions),
            ("waiting", "Gets parked now, waiting for a publish.", st.waiting),
        ):
            yield GaugeMetricFamily(f"tensordepot_{name}", help_text, value=value)


def _per_device(family: Family, value: float) -> Family:
    family.add_metric([DEVICE], value)
    return family
