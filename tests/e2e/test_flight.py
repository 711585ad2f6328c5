"""Brokers on several hosts: pull-through replicas, push, and failures, over
real Arrow Flight between real broker processes.

"Another host" is a broker in a mount namespace with its own /dev/shm
(tests/_hosts.py): it cannot see the first broker's segments, so every byte
it serves must have crossed Flight.  Its workers run in the same namespace.
Every broker is checked for clean accounting and an empty /dev/shm at the
end (the ``broker_factory`` fixture), on its own host.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, wait_for
from _hosts import Host, Relay, flight_url, why_no_hosts
from _workerio import Worker, metrics
from tensordepot import AuthError, BrokerUnavailable, InvalidRequest, TensorNotFound

pa = pytest.importorskip("pyarrow")
fl = pytest.importorskip("pyarrow.flight")

MiB = 1 << 20
TOKEN = "flight-test-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"
PUB_TOKEN = "pub-read-token-0123456789abcdef"
WRITE_TOKEN = "write-token-0123456789abcdef"
ENV = {"TENSORDEPOT_TOKEN": TOKEN}


def tensor(nbytes: int, seed: int) -> tuple[np.ndarray, str]:
    x = np.random.default_rng(seed).integers(0, 1 << 63, size=nbytes // 8, dtype=np.uint64)
    return x, hashlib.sha256(x.data).hexdigest()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class Net:
    """Brokers on hosts: ``origin()`` in this namespace, ``remote()`` each on a host of its own."""

    def __init__(self, hosts: Callable[[], Host], brokers: Callable[..., BrokerProc]) -> None:
        self._hosts, self._brokers = hosts, brokers

    def origin(self, *args: str) -> BrokerProc:
        return self._brokers("--flight", "grpc://127.0.0.1:0", *args, env=ENV)

    def remote(self, *args: str) -> tuple[Host, BrokerProc]:
        host = self._hosts()
        return host, self._brokers(*args, env=ENV, launcher=host.launcher, shm_dir=host.shm_dir)

    @staticmethod
    def reader(workers: Callable[..., Worker], host: Host, broker: BrokerProc) -> Worker:
        return workers(
            "flight_reader", broker.url, launcher=host.launcher, ready="ready", ready_timeout=60
        )


@pytest.fixture
def host_factory() -> Iterator[Callable[[], Host]]:
    """Hosts outlive the brokers on them (``net`` sets up brokers after hosts)."""
    why = why_no_hosts()
    if why:
        pytest.skip(why)
    made: list[Host] = []

    def make() -> Host:
        made.append(Host())
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture
def net(host_factory: Callable[[], Host], broker_factory: Callable[..., BrokerProc]) -> Net:
    return Net(host_factory, broker_factory)


def got(line: str) -> dict[str, Any]:
    """A reader's ``ok`` line."""
    parts = line.split()
    assert parts[0] == "ok", line
    return {
        "version": int(parts[1]),
        "sha": parts[2],
        "origin": parts[3],
        "origin_version": int(parts[4]) if parts[4] != "None" else None,
    }


def peer_metric(url: str, name: str, peer: str) -> float:
    return metrics(url).get(f'tensordepot_{name}{{peer="{peer}"}}', 0.0)


def served(url: str, name: str) -> float:
    """A Flight counter summed over every peer that asked."""
    return sum(v for k, v in metrics(url).items() if k.startswith(f"tensordepot_flight_{name}{{"))


# -- pulling ------------------------------------------------------------------------


def test_eight_consumers_on_another_host_share_one_transfer(
    net: Net, workers: Callable[..., Worker]
) -> None:
    a = net.origin()
    host, b = net.remote("--peer", flight_url(a))
    x, digest = tensor(64 * MiB, 1)
    with a.client() as c:
        c.put("weights", x)
    readers = [workers("flight_reader", b.url, launcher=host.launcher) for _ in range(8)]
    for w in readers:
        w.expect("ready", 60)
    for w in readers:  # all at once: the first miss starts the transfer, the rest wait on it
        w.send("get weights 60")
    answers = [got(w.line(120)) for w in readers]
    assert all(g["sha"] == digest for g in answers), "a consumer read different bytes"
    assert {(g["version"], g["origin"], g["origin_version"]) for g in answers} == {
        (1, flight_url(a), 1)
    }
    peer = flight_url(a)
    assert peer_metric(b.url, "peer_transfers_total", peer) == 1
    assert peer_metric(b.url, "peer_bytes_pulled_total", peer) == 64 * MiB
    assert metrics(b.url)["tensordepot_replicas"] == 1
    assert served(a.url, "streams_served_total") == 1
    assert served(a.url, "bytes_served_total") == 64 * MiB
    # Another host indeed: B's memory is its own tmpfs, where none of A's segments are.
    assert os.stat(host.shm_dir).st_dev != os.stat("/dev/shm").st_dev
    assert b.segments() and not set(a.segments()) & set(host.entries())


@pytest.mark.parametrize("refresh", [pytest.param(0.0, id="every-get"), pytest.param(1.0, id="1s")])
def test_supersede_on_origin_reaches_the_replica_within_the_refresh_setting(
    net: Net, workers: Callable[..., Worker], refresh: float
) -> None:
    a = net.origin()
    host, b = net.remote("--peer", flight_url(a), "--peer-refresh", str(refresh))
    r = net.reader(workers, host, b)
    x1, d1 = tensor(4 * MiB, 2)
    x2, d2 = tensor(4 * MiB, 3)
    with a.client() as c:
        c.put("w", x1)
        first = got(r.ask("get w 0", "ok"))
        last_check = time.monotonic()  # B checked A no later than this
        assert (first["sha"], first["origin_version"]) == (d1, 1)
        c.put("w", x2)
    deadline = last_check + refresh + 30
    while True:
        sent = time.monotonic()
        g = got(r.ask("get w 0", "ok"))
        if g["origin_version"] == 2:
            break
        # Stale is allowed only within the refresh setting of B's last check.
        assert sent < last_check + refresh, f"stale {sent - last_check:.2f} s after the last check"
        assert sent < deadline
        time.sleep(0.02)
    assert g["sha"] == d2 and g["version"] == 2
    peer = flight_url(a)
    # One metadata call per refresh window, one transfer per version.
    assert peer_metric(b.url, "peer_checks_total", peer) == 2
    assert peer_metric(b.url, "peer_transfers_total", peer) == 2


def test_a_get_on_another_host_waits_for_a_name_that_exists_nowhere_yet(
    net: Net, workers: Callable[..., Worker]
) -> None:
    a = net.origin()
    host, b = net.remote("--peer", flight_url(a), "--peer-refresh", "0.2")
    r = net.reader(workers, host, b)
    r.send("get later 60")
    wait_for(
        lambda: peer_metric(b.url, "peer_checks_total", flight_url(a)) >= 2,
        30,
        what="B to ask A again while the get waits",
    )
    x, digest = tensor(1 * MiB, 4)
    with a.client() as c:
        c.put("later", x)
    assert got(r.line(60))["sha"] == digest
    # get_many pulls what it misses the same way.
    (y, dy), (z, dz) = tensor(2 * MiB, 10), tensor(3 * MiB, 11)
    with a.client() as c:
        c.put_many({"y": y, "z": z})
    assert r.ask("many later,y,z", "ok").split()[1:] == [digest, dy, dz]
    assert peer_metric(b.url, "peer_transfers_total", flight_url(a)) == 3


def test_peers_chain(net: Net, workers: Callable[..., Worker]) -> None:
    a = net.origin()
    _, b = net.remote("--flight", "grpc://127.0.0.1:0", "--peer", flight_url(a))
    host_c, c = net.remote("--peer", flight_url(b))
    x, digest = tensor(8 * MiB, 5)
    with a.client() as ca:
        ca.put("emb", x)
    r = net.reader(workers, host_c, c)
    g = got(r.ask("get emb 30", "ok"))
    # C's replica names where the tensor was published, not the hop it came through.
    assert (g["sha"], g["origin"], g["origin_version"]) == (digest, flight_url(a), 1)
    with b.client() as cb:
        [info] = cb.list()
    assert (info.name, info.origin, info.origin_version) == ("emb", flight_url(a), 1)
    assert peer_metric(b.url, "peer_transfers_total", flight_url(a)) == 1
    assert peer_metric(c.url, "peer_transfers_total", flight_url(b)) == 1
    assert served(a.url, "bytes_served_total") == served(b.url, "bytes_served_total") == 8 * MiB


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def test_brokers_that_peer_with_each_other_do_not_loop(
    net: Net, workers: Callable[..., Worker]
) -> None:
    b_url = f"grpc://127.0.0.1:{free_port()}"
    a = net.origin("--peer", b_url, "--peer-refresh", "0")
    host, b = net.remote("--flight", b_url, "--peer", flight_url(a), "--peer-refresh", "0")
    # A asks B for what it lacks, and B asks A: a name on neither ends at once, on both.
    r = net.reader(workers, host, b)
    line = r.ask("get nowhere 0", "error")
    assert "TensorNotFound" in line and "no peer holds it" in line, line
    with a.client() as c:
        with pytest.raises(TensorNotFound, match="no peer holds it"):
            c.get("nowhere")
        c.put("w", np.arange(4, dtype=np.float32))
    assert got(r.ask("get w 0", "ok"))["origin"] == flight_url(a)


# -- failures -------------------------------------------------------------------------


def test_a_replica_is_served_as_it_is_while_its_origin_is_unreachable(
    net: Net, workers: Callable[..., Worker]
) -> None:
    a = net.origin()
    host, b = net.remote("--peer", flight_url(a), "--peer-refresh", "0", "--peer-timeout", "2")
    r = net.reader(workers, host, b)
    x, digest = tensor(2 * MiB, 12)
    with a.client() as c:
        c.put("w", x)
    assert got(r.ask("get w 0", "ok"))["sha"] == digest
    assert a.stop() == 0 and a.segments() == []
    a.expect_dead = True  # type: ignore[attr-defined]
    g = got(r.ask("get w 0", "ok"))  # due for a check, which fails: the replica is served
    assert (g["sha"], g["origin_version"]) == (digest, 1)
    assert "serving replica 'w' v1 as it is" in b.log()
    line = r.ask("get other 0", "error")  # a miss has nothing to serve
    assert line.startswith("error BrokerUnavailable") and flight_url(a) in line, line


@dataclass
class Paused:
    a: BrokerProc
    b: BrokerProc
    relay: Relay
    reader: Worker
    digest: str


@pytest.fixture
def paused(net: Net, workers: Callable[..., Worker]) -> Iterator[Callable[..., Paused]]:
    """A pull of NAME (NBYTES) from A by B on another host, held part way: B
    reaches A through a relay that stops forwarding after a quarter of it."""
    relays: list[Relay] = []

    def start(name: str, nbytes: int, *b_args: str) -> Paused:
        a = net.origin()
        relays.append(relay := Relay(("127.0.0.1", port_of(flight_url(a)))))
        host, b = net.remote("--peer", relay.url, "--peer-timeout", "60", *b_args)
        x, digest = tensor(nbytes, 6)
        with a.client() as c:
            c.put(name, x)
        r = net.reader(workers, host, b)
        relay.hold_after(nbytes // 4)
        r.send(f"get {name} 30")
        assert relay.held.wait(60), "the transfer never started"
        return Paused(a, b, relay, r, digest)

    yield start
    for relay in relays:
        relay.close()


def test_origin_killed_mid_transfer_leaves_no_replica_and_no_leak(
    paused: Callable[..., Paused],
) -> None:
    p = paused("big", 64 * MiB)
    # What the relay let through reaches B's books a moment after the relay holds.
    wait_for(
        lambda: peer_metric(p.b.url, "peer_bytes_pulled_total", p.relay.url) > 0,
        30,
        what="B to count the bytes the relay let through",
    )
    pulled = peer_metric(p.b.url, "peer_bytes_pulled_total", p.relay.url)
    assert 0 < pulled < 64 * MiB, pulled
    with p.b.client() as cb:  # part way: B holds an allocation nobody can see
        assert cb.list() == []
        assert cb.stat().bytes_in_use == 64 * MiB
    p.a.kill()
    p.a.expect_dead = True  # type: ignore[attr-defined]
    p.relay.release()  # what A had sent reaches B, then the connection ends
    line = p.reader.line(60)
    assert line.startswith("error BrokerUnavailable") and p.relay.url in line, line
    assert "partial copy was discarded" in line, line
    st = p.b.stat()
    assert (st.bytes_in_use, st.versions, st.leases, st.tensors) == (0, 0, 0, 0), st
    with p.b.client() as cb:
        assert cb.list() == []
    assert peer_metric(p.b.url, "peer_transfer_failures_total", p.relay.url) == 1
    assert peer_metric(p.b.url, "peer_transfers_total", p.relay.url) == 0


def test_a_transfer_that_stalls_is_abandoned_after_the_peer_timeout(
    paused: Callable[..., Paused],
) -> None:
    p = paused("w", 16 * MiB, "--peer-timeout", "1")  # the network goes quiet, nothing closes
    line = p.reader.line(60)
    assert line.startswith("error BrokerUnavailable"), line
    assert f"peer {p.relay.url} sent nothing for 1 s" in line, line
    st = p.b.stat()
    assert (st.bytes_in_use, st.versions, st.tensors) == (0, 0, 0), st
    p.relay.release()
    assert got(p.reader.ask("get w 30", "ok"))["sha"] == p.digest, "B did not recover"


def test_a_stream_holds_a_lease_so_a_delete_mid_transfer_frees_nothing_early(
    paused: Callable[..., Paused],
) -> None:
    p = paused("w", 32 * MiB, "--peer-refresh", "0")
    with p.a.client() as c:
        c.delete("w")
        st = c.stat()
        assert st.leases == 1 and st.bytes_in_use == 32 * MiB, st  # the stream's lease
    p.relay.release()
    assert got(p.reader.line(60))["sha"] == p.digest, "bytes sent after the delete changed"
    wait_for(lambda: p.a.stat().bytes_in_use == 0, 10, what="A to free 'w' after the stream")
    # The origin no longer has it: B's next check drops its replica too.
    line = p.reader.ask("get w 0", "error")
    assert "TensorNotFound" in line, line


def test_unreachable_peers_answer_within_the_timeout(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts TCP, never speaks gRPC
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        silent_url = f"grpc://127.0.0.1:{silent.getsockname()[1]}"
        closed_url = f"grpc://127.0.0.1:{closed_port}"
        b = broker_factory("--peer", silent_url, "--peer", closed_url, "--peer-timeout", "1")
        with b.client() as c:
            start = time.monotonic()
            with pytest.raises(BrokerUnavailable) as err:
                c.get("w")
            took = time.monotonic() - start
            assert took < 1 + 5, f"took {took:.1f} s with --peer-timeout 1"
            msg = str(err.value)
            assert f"peer {silent_url} did not answer within 1 s" in msg, msg
            assert f"peer {closed_url}" in msg, msg
            # A get that may wait keeps waiting, then says what the peers did.
            with pytest.raises(TensorNotFound, match="peers could not be asked"):
                c.get("w", timeout=0.5)
    finally:
        silent.close()


# -- pushing ----------------------------------------------------------------------------


def test_push_sends_a_version_to_another_host(net: Net, workers: Callable[..., Worker]) -> None:
    a = net.origin()
    host, b = net.remote("--flight", "grpc://127.0.0.1:0")
    x, digest = tensor(16 * MiB, 8)
    with a.client() as c:
        c.put("ckpt", x)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensordepot",
            "push",
            "ckpt",
            "--to",
            flight_url(b),
            "--url",
            a.url,
        ],
        env={**os.environ, "TENSORDEPOT_PEER_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"ckpt: version 1 at {flight_url(b)}"
    r = net.reader(workers, host, b)
    g = got(r.ask("get ckpt 0", "ok"))
    assert (g["sha"], g["version"], g["origin"]) == (digest, 1, "None")  # pushed: B's own now
    assert served(b.url, "bytes_pushed_total") == 16 * MiB
    assert served(b.url, "pushes_total") == 1
    with a.client() as c:
        assert c.push("ckpt", flight_url(b), token=TOKEN) == 2
        with pytest.raises(AuthError) as err:
            c.push("ckpt", flight_url(b), token="not-a-token-at-all")
        assert err.value.status == 401 and TOKEN not in str(err.value)
        with pytest.raises(InvalidRequest, match="grpc://HOST:PORT"):
            c.push("ckpt", "http://127.0.0.1:1")
    assert got(r.ask("get ckpt 0", "ok"))["version"] == 2


# -- the Flight endpoint itself ------------------------------------------------------------


@pytest.fixture
def scoped(broker_factory: Callable[..., BrokerProc], tmp_path: Path) -> BrokerProc:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "# token scope [prefix=...]: the broker's own tokens, HTTP and Flight "
        f"alike\n{READ_TOKEN} read\n{PUB_TOKEN} read prefix=pub/\n{WRITE_TOKEN} "
        "write\n"
    )
    tokens.chmod(0o600)
    b = broker_factory("--flight", "grpc://127.0.0.1:0", "--token-file", str(tokens), env=ENV)
    with b.client() as c:
        c.put("pub/w", np.arange(10, dtype=np.float32))
        c.put("secret", np.arange(10, dtype=np.float32))
    return b


def options(token: str | None) -> Any:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return fl.FlightCallOptions(headers=headers, timeout=10)


def put_stream(client: Any, name: str, token: str, meta: dict[str, Any], data: bytes) -> Any:
    sch = pa.schema([("bytes", pa.uint8())], metadata={b"tensordepot": json.dumps(meta).encode()})
    writer, reader = client.do_put(fl.FlightDescriptor.for_path(name), sch, options(token))
    writer.write_batch(pa.record_batch([pa.array(np.frombuffer(data, np.uint8))], schema=sch))
    writer.done_writing()
    answer = reader.read()
    writer.close()
    return answer


def test_tokens_without_the_scope_are_refused(
    scoped: BrokerProc, broker_factory: Callable[..., BrokerProc]
) -> None:
    url = flight_url(scoped)
    with fl.connect(url) as client:
        for token in (None, "unknown-token-0123456789"):
            with pytest.raises(fl.FlightUnauthenticatedError, match="missing or unknown token"):
                client.get_flight_info(fl.FlightDescriptor.for_path("pub/w"), options(token))
            with pytest.raises(fl.FlightUnauthenticatedError):
                client.do_get(fl.Ticket(b"pub/w"), options(token)).read_all()
        # A read token limited to pub/ has no read scope on other names.
        with pytest.raises(
            fl.FlightUnauthorizedError, match="limited to names starting with 'pub/'"
        ):
            client.do_get(fl.Ticket(b"secret"), options(PUB_TOKEN)).read_all()
        assert client.do_get(fl.Ticket(b"pub/w"), options(PUB_TOKEN)).read_all().num_rows == 40
        listed = [i.descriptor.path[0] for i in client.list_flights(options=options(PUB_TOKEN))]
        assert listed == [b"pub/w"]
        # A read token cannot push.
        meta = {"name": "pub/w", "version": 1, "shape": [10], "dtype": "float32", "nbytes": 40}
        with pytest.raises(fl.FlightUnauthorizedError, match="needs 'write'"):
            put_stream(client, "pub/w", READ_TOKEN, meta, bytes(40))
        assert put_stream(client, "pub/w", WRITE_TOKEN, meta, bytes(40)) is not None
    with scoped.client() as c:
        assert {i.name: i.version for i in c.list()} == {"pub/w": 2, "secret": 1}
    # A broker pulling with a token that lacks the scope says so, naming the peer.
    b = broker_factory("--peer", url, env={"TENSORDEPOT_PEER_TOKEN": PUB_TOKEN})
    with (
        b.client() as c,
        pytest.raises(BrokerUnavailable, match="refused this broker's token") as err,
    ):
        c.get("secret")
    assert url in str(err.value) and PUB_TOKEN not in str(err.value)


def test_unknown_names_and_bad_tickets_are_refused_with_a_message(scoped: BrokerProc) -> None:
    """Refusals are Flight errors with our message and our code (the code is
    checked in test_trust_peers.py): no NOT_FOUND or INVALID_ARGUMENT, which
    pyarrow can only send with the broker's traceback."""
    with fl.connect(flight_url(scoped)) as client:
        opts = options(TOKEN)
        with pytest.raises(fl.FlightServerError, match="tensor 'nope' not found"):
            client.get_flight_info(fl.FlightDescriptor.for_path("nope"), opts)
        with pytest.raises(fl.FlightServerError, match="version 7 of 'secret' is not the newest"):
            client.do_get(fl.Ticket(b"secret@7"), opts).read_all()
        for bad in (b"\xff\xfe", b"has space", b""):
            with pytest.raises(fl.FlightServerError, match="bad ticket"):
                client.do_get(fl.Ticket(bad), opts).read_all()
        with pytest.raises(fl.FlightServerError, match="bad descriptor"):
            client.get_flight_info(fl.FlightDescriptor.for_command(b"secret"), opts)
        # Tickets and descriptors go through the one name check: a trailing
        # newline, a space or a control character is refused, not cut off.
        for bad in (b"secret\n", b"secret\n@1", b"sec\x00ret"):
            with pytest.raises(fl.FlightServerError, match="bad ticket"):
                client.do_get(fl.Ticket(bad), opts).read_all()
        for bad in (b"secret\n", b"has space", b"tab\there"):
            with pytest.raises(fl.FlightServerError, match="is not a valid tensor name"):
                client.get_flight_info(fl.FlightDescriptor.for_path(bad), opts)
        with pytest.raises(fl.FlightServerError, match="a tensor name is ASCII"):
            client.get_flight_info(fl.FlightDescriptor.for_path("caf\u00e9".encode()), opts)
        # A descriptor holds a name, never a ticket's @version.
        with pytest.raises(fl.FlightServerError, match="tensor 'secret@1' not found"):
            client.get_flight_info(fl.FlightDescriptor.for_path("secret@1"), opts)
        info = client.get_flight_info(fl.FlightDescriptor.for_path("secret"), opts)
        meta = json.loads(info.schema.metadata[b"tensordepot"])
        got = (meta["shape"], meta["dtype"], meta["version"], meta["nbytes"])
        assert got == ([10], "float32", 1, 40)
        assert info.total_bytes == 40 and info.endpoints[0].ticket.ticket == b"secret@1"
        table = client.do_get(info.endpoints[0].ticket, opts).read_all()
        assert table.column(0).to_numpy().tobytes() == np.arange(10, dtype=np.float32).tobytes()
        # Pushes that do not add up are refused, and leave nothing behind.
        meta = {"name": "x", "version": 1, "shape": [10], "dtype": "float32", "nbytes": 40}
        with pytest.raises(fl.FlightServerError, match="carried 20 bytes"):
            put_stream(client, "x", TOKEN, meta, bytes(20))
        with pytest.raises(fl.FlightServerError, match="more than the 40 bytes"):
            put_stream(client, "x", TOKEN, meta, bytes(80))
        with pytest.raises(fl.FlightServerError, match="unknown dtype 'float99'"):
            put_stream(client, "x", TOKEN, {**meta, "dtype": "float99"}, bytes(40))
    with scoped.client() as c:
        assert sorted(i.name for i in c.list()) == ["pub/w", "secret"]
    wait_for(lambda: scoped.stat().versions == 2, 10, what="refused pushes to be given back")


class _LyingPeer(fl.FlightServerBase):  # type: ignore[misc]
    """A Flight server that answers every lookup with another tensor's metadata."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.answer = answer

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        sch = pa.schema(
            [("bytes", pa.uint8())], metadata={b"tensordepot": json.dumps(self.answer).encode()}
        )
        ticket = fl.Ticket(f"{self.answer['name']}@1".encode())
        return fl.FlightInfo(sch, descriptor, [fl.FlightEndpoint(ticket, [])], 40, 40)


@pytest.mark.parametrize(
    "answered", [pytest.param("other", id="another-name"), pytest.param("asked\n", id="newline")]
)
def test_a_peer_answer_for_another_name_is_refused(
    answered: str, broker_factory: Callable[..., BrokerProc]
) -> None:
    """What a peer names is what this broker would allocate and publish: its
    answer must name the tensor asked for, and pass the one name check."""
    meta = {
        "name": answered,
        "version": 1,
        "shape": [10],
        "dtype": "float32",
        "nbytes": 40,
        "origin": "grpc://liar:1",
        "origin_instance": "liar",
        "origin_version": 1,
    }
    liar = _LyingPeer(meta)
    try:
        b = broker_factory("--peer", f"grpc://127.0.0.1:{liar.port}")
        with b.client() as c:
            with pytest.raises(BrokerUnavailable, match="not a tensordepot stream"):
                c.get("asked")
            assert c.list() == []
    finally:
        liar.shutdown()


def test_tls(broker_factory: Callable[..., BrokerProc], tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    res = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {res.stderr.strip()[:200]}")
    a = broker_factory(
        "--flight",
        "grpc+tls://127.0.0.1:0",
        "--flight-tls-cert",
        str(cert),
        "--flight-tls-key",
        str(key),
        env=ENV,
    )
    url = flight_url(a)
    assert url.startswith("grpc+tls://")
    b = broker_factory("--peer", url, "--peer-tls-ca", str(cert), env=ENV)
    x, _ = tensor(2 * MiB, 9)
    with a.client() as c:
        c.put("w", x)
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("w")), x)
    with fl.connect(url) as untrusting, pytest.raises(fl.FlightUnavailableError):
        untrusting.get_flight_info(fl.FlightDescriptor.for_path("w"), options(TOKEN))
    with fl.connect(url, tls_root_certs=cert.read_bytes()) as trusting:
        info = trusting.get_flight_info(fl.FlightDescriptor.for_path("w"), options(TOKEN))
        assert info.total_bytes == x.nbytes


@pytest.mark.parametrize(
    ("args", "message", "token"),
    [
        pytest.param(["--flight", "grpc://127.0.0.1:0"], "needs a token", False, id="no-token"),
        pytest.param(["--flight", "http://127.0.0.1:1"], "use grpc://HOST:PORT", True, id="scheme"),
        pytest.param(["--peer", "127.0.0.1:8815"], "--peer '127.0.0.1:8815'", True, id="peer"),
        pytest.param(
            ["--flight", "grpc+tls://127.0.0.1:0"], "needs --flight-tls-cert", True, id="tls"
        ),
    ],
)
def test_bad_flight_settings_fail_at_start(
    args: list[str],
    message: str,
    token: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve`` itself, in this process: it stops before the broker starts.  A
    Flight listener, loopback included, needs a token like every TCP listener."""
    from tensordepot.cli import main

    for key in [k for k in os.environ if k.startswith("TENSORDEPOT_")]:
        monkeypatch.delenv(key)
    if token:
        monkeypatch.setenv("TENSORDEPOT_TOKEN", TOKEN)
    sock = tmp_path / "b.sock"
    rc = main(["serve", "--listen", f"unix://{sock}", "--shm-prefix", f"{TEST_PREFIX}bad-", *args])
    err = capsys.readouterr().err
    assert rc != 0 and message in err, err
    assert not sock.exists(), "the listener bound before the failure was not closed"
