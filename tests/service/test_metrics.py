"""GET /metrics: known actions against a real broker, then the scrape read
back through prometheus_client's own parser."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _workerio import http_get
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tensordepot import OutOfMemory, TensorNotFound, __version__
from tensordepot.service import Settings, create_app
from tensordepot.service._http._routes import match
from tensordepot.service._metrics import UNMATCHED

LATENCY = "tensordepot_http_request_duration_seconds"
MiB = 1 << 20


class Scrape:
    """One scrape of /metrics, parsed."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.samples = [s for f in self.families for s in f.samples]

    def find(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        found = self.find(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {found}"
        return found[0].value

    def requests(self, method: str, route: str, status: str | None = None) -> float:
        labels = {"method": method, "route": route} | ({"status": status} if status else {})
        return sum(s.value for s in self.find(f"{LATENCY}_count", **labels))


def scrape(url: str) -> Scrape:
    status, headers, body = http_get(url, "/metrics")
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain; version="), headers
    return Scrape(body)


def reaped_orphan_writer(url: str) -> None:
    """A producer that allocates and dies without publishing or closing."""
    code = (
        "import os, sys; from tensordepot import Client; c = Client(sys.argv[1]); "
        "c.empty('orphan', (8,), 'float64'); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, url], check=True, timeout=60)


def test_metrics_match_known_actions(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory("--segment-size", "4MiB", max_memory="64MiB")
    with b.client() as c:
        c.put("small", np.arange(250, dtype=np.int32))  # 1000 bytes, sent inline: POST /v1/put
        c.put("big", np.zeros(MiB, np.uint8))  # alloc + publish
        # Each get while the last one's view lives: each asks the broker (a get
        # whose lease is still held, its views gone, is answered by the client).
        held = [c.get("small") for _ in range(3)]
        held += [c.get("big") for _ in range(2)]
        del held
        with pytest.raises(TensorNotFound):
            c.get("absent")
        c.delete("small")
        with pytest.raises(OutOfMemory):
            c.empty("huge", (128 * MiB,), "uint8")  # past --max-memory: 507
        c.put("brief", np.ones(4, np.float32), ttl=0.05)  # 16 bytes, then expires
        wait_for(lambda: "brief" not in {i.name for i in c.list()}, 10, what="the ttl to expire")
    reaped_orphan_writer(b.url)
    assert http_get(b.url, "/no/such/route")[0] == 404
    assert http_get(b.url, "/v1/tensors/some/deep/name")[0] in (400, 404, 422)

    m = wait_for(
        lambda: (
            (s := scrape(b.url)).value("tensordepot_sessions_reaped_total") == 1
            and s.value("tensordepot_leases") == 0
            and s
        ),
        10,
        what="the orphan writer's session to be reaped and the leases released",
    )

    # Counters: the broker's own events.
    assert m.value("tensordepot_bytes_put_total", device="cpu") == 1000 + MiB + 16
    assert m.value("tensordepot_bytes_got_total", device="cpu") == 3 * 1000 + 2 * MiB
    expected = {
        "gets": 5,
        "publishes": 3,
        "allocs": 4,
        "deletes": 2,
        "expired": 1,
        "quota_refusals": 1,
        "sessions_reaped": 1,
        "writes_reclaimed": 1,
    }
    got = {k: m.value(f"tensordepot_{k}_total") for k in expected}
    assert got == expected
    opened, ended = "tensordepot_sessions_opened_total", "tensordepot_sessions_ended_total"
    assert m.value(opened) == m.value(ended) == 2

    # Gauges: computed at scrape time from the broker's accounting.
    assert m.value("tensordepot_tensors") == 1 and m.value("tensordepot_versions") == 1
    assert m.value("tensordepot_sessions") == 0 and m.value("tensordepot_leases") == 0
    assert m.value("tensordepot_memory_in_use_bytes", device="cpu") == MiB
    assert m.value("tensordepot_memory_limit_bytes", device="cpu") == 64 * MiB
    reserved = m.value("tensordepot_memory_reserved_bytes", device="cpu")
    warm = m.value("tensordepot_memory_warm_free_bytes", device="cpu")
    assert reserved >= 4 * MiB and 0 < warm <= reserved - MiB
    assert m.value("tensordepot_segments", device="cpu") >= 1
    assert m.value("tensordepot_build_info", version=__version__) == 1

    # The latency histogram, by route template: the hot paths included.
    tensors = "/v1/tensors/{name}"
    assert m.requests("GET", tensors, "200") == 5  # the gets
    assert m.requests("GET", tensors, "404") == 1  # "absent"
    assert m.requests("GET", tensors) == 7  # and the raw probe of some/deep/name
    assert m.requests("DELETE", tensors, "204") == 1
    assert m.requests("POST", "/v1/put/{name}", "200") == 2  # small, brief
    assert m.requests("POST", "/v1/alloc", "200") == 2  # big, orphan
    assert m.requests("POST", "/v1/alloc", "507") == 1  # huge
    assert m.requests("GET", "unmatched", "404") == 1
    routes = {s.labels["route"] for s in m.find(f"{LATENCY}_count")}
    assert not {r for r in routes if "small" in r or "big" in r or "deep" in r}, routes
    check_histograms(m)

    # HELP on every metric, and every name ours.
    assert m.families and all(f.name.startswith("tensordepot_") for f in m.families)
    undocumented = [f.name for f in m.families if not f.documentation.strip()]
    assert not undocumented


def check_histograms(m: Scrape) -> None:
    """Per series: cumulative buckets, +Inf equals _count, and a sum."""
    series: dict[tuple[tuple[str, str], ...], list[Sample]] = {}
    for s in m.find(f"{LATENCY}_bucket"):
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        series.setdefault(key, []).append(s)
    assert series
    for key, buckets in series.items():
        labels = dict(key)
        ordered = sorted(buckets, key=lambda s: float(s.labels["le"]))
        counts = [s.value for s in ordered]
        assert counts == sorted(counts), (labels, counts)
        assert ordered[-1].labels["le"] == "+Inf"
        assert counts[-1] == m.value(f"{LATENCY}_count", **labels) > 0
        assert m.value(f"{LATENCY}_sum", **labels) > 0


def _count(text: bytes, route: str) -> float:
    samples: Iterable[Sample] = (
        s for f in text_string_to_metric_families(text.decode()) for s in f.samples
    )
    return sum(
        s.value for s in samples if s.name == f"{LATENCY}_count" and s.labels["route"] == route
    )


def test_batches_count_each_tensor(broker_factory: Callable[..., BrokerProc]) -> None:
    """A batch counts its tensors once each, on every path: a put_many, a
    get_many answered at once and one that waits for the next versions.  Its
    tensors of one pack share one lease, released once.  A get_many that
    fails counts the tensors it leased and gave back as gets, and their lease
    as a release (one that fails at once takes none)."""
    b = broker_factory()
    sizes = {"a": 3, "b": 5, "c": 7}
    batch = {n: np.zeros(k, np.float32) for n, k in sizes.items()}
    nbytes = 4 * sum(sizes.values())
    with b.client() as c, b.client() as waiter:
        c.put_many(batch)
        got = c.get_many(list(batch))  # ready now
        with pytest.raises(TensorNotFound):
            c.get_many([*batch, "absent"], timeout=0)  # fails before it leases anything
        with pytest.raises(TensorNotFound):
            # leases a, b, c before it waits for "absent", then gives them back
            c.get_many([*batch, "absent"], timeout=0.2)
        parked: list[dict[str, Any]] = []

        def wait_next() -> None:
            parked.append(
                waiter.get_many(list(batch), timeout=60, newer_than={n: 1 for n in batch})
            )

        th = threading.Thread(target=wait_next)
        th.start()
        wait_for(
            lambda: scrape(b.url).value("tensordepot_waiting") == 1, 10, what="the get_many to park"
        )
        c.put_many(batch)  # the next versions: the parked get_many takes them
        th.join(30)
        assert {n: t.version for n, t in parked[0].items()} == {n: 2 for n in batch}
        del got
        parked.clear()
        m = wait_for(
            lambda: (s := scrape(b.url)).value("tensordepot_leases") == 0 and s,
            10,
            what="every lease to be released",
        )
    assert m.value("tensordepot_bytes_put_total", device="cpu") == 2 * nbytes
    assert m.value("tensordepot_bytes_got_total", device="cpu") == 3 * nbytes
    # 9 tensors got in 3 get_many, each batch one pack: 3 leases, 3 releases.
    expected = {"publishes": 6, "gets": 9, "releases": 3, "allocs": 6}
    assert {k: m.value(f"tensordepot_{k}_total") for k in expected} == expected


def test_each_app_has_a_registry_of_its_own() -> None:
    """Two brokers in one process keep apart, and neither uses the global registry."""
    a, b = create_app(Settings()), create_app(Settings())
    assert a.state.metrics.registry is not b.state.metrics.registry
    a.state.metrics.observe_route("GET", "/v1/tensors/{name}", 200, 0.002)
    # an unknown method is "other"
    a.state.metrics.observe_route("BREW", "/v1/tensors/{name}", 200, 0.002)
    assert _count(a.state.metrics.render(), "/v1/tensors/{name}") == 2
    assert _count(b.state.metrics.render(), "/v1/tensors/{name}") == 0
    text = a.state.metrics.render().decode()
    assert 'method="other"' in text and "BREW" not in text
    assert b"tensordepot_" not in generate_latest(REGISTRY)


@pytest.mark.parametrize(
    ("path", "template"),
    [
        pytest.param("/v1/tensors/w", "/v1/tensors/{name}", id="tensor"),
        pytest.param("/v1/tensors/a/b/c", "/v1/tensors/{name}", id="tensor-with-slashes"),
        pytest.param("/v1/tensors", "/v1/tensors", id="list"),
        pytest.param("/v1/put/w", "/v1/put/{name}", id="put"),
        pytest.param("/v1/sessions/abc", "/v1/sessions/{session}", id="session"),
        pytest.param(
            "/v1/sessions/abc/heartbeat", "/v1/sessions/{session}/heartbeat", id="heartbeat"
        ),
        pytest.param("/v1/many/alloc", "/v1/many/alloc", id="batch"),
        pytest.param("/metrics", "/metrics", id="metrics"),
        pytest.param("/wp-login.php", "unmatched", id="unmatched"),
    ],
)
def test_route_templates(path: str, template: str) -> None:
    """The route label is the template of the route the path matches."""
    found = [r for r in (match(m, path)[0] for m in ("GET", "POST", "DELETE")) if r is not None]
    assert (found[0].template if found else UNMATCHED) == template


# -- Flight and peers: collectors in the app's registry ----------------------------------------


class _TrafficOf:
    """A collector of one ``Traffic``, as ``FlightService`` and ``Peers`` are."""

    def __init__(self, metrics: Any) -> None:
        from tensordepot.service._hosts._peers import Traffic

        self.traffic = Traffic()
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        return self.traffic.families(self.metrics)


def test_peer_metrics_escape_their_labels() -> None:
    """A peer's name (a ``--peer`` URL, or what a caller declares) is a label
    value: a newline, a quote or a backslash in it cannot start a sample of
    its own or end the label early."""
    from tensordepot.service._hosts._flight import FLIGHT_METRICS
    from tensordepot.service._hosts._peers import PEER_METRICS

    app = create_app(Settings())
    metrics = app.state.metrics
    flight, peers = _TrafficOf(FLIGHT_METRICS), _TrafficOf(PEER_METRICS)
    evil = 'grpc://h:1"} 1\ntensordepot_fake 9\n\\'
    flight.traffic.add(evil, "streams_served", 1)
    flight.traffic.add(evil, "bytes_served", 4096)
    peers.traffic.add(evil, "transfers", 2)
    peers.traffic.add(evil, "seconds", 0.5)
    metrics.add(flight)
    metrics.add(peers)
    text = metrics.render().decode()
    assert '{peer="grpc://h:1\\"} 1\\ntensordepot_fake 9\\n\\\\"}' in text, text
    assert not any(line.startswith("tensordepot_fake") for line in text.splitlines())
    scraped = Scrape(text)
    assert scraped.value("tensordepot_flight_streams_served_total", peer=evil) == 1
    assert scraped.value("tensordepot_flight_bytes_served_total", peer=evil) == 4096
    assert scraped.value("tensordepot_peer_transfer_seconds_count", peer=evil) == 2
    assert scraped.value("tensordepot_peer_transfer_seconds_sum", peer=evil) == 0.5
    assert scraped.find("tensordepot_fake") == []
    for family in scraped.families:  # every family has HELP text and a type
        assert family.documentation and family.type != "unknown", family.name

    metrics.remove(flight)
    assert "tensordepot_flight_" not in metrics.render().decode()
    assert "tensordepot_peer_transfers_total" in metrics.render().decode()
