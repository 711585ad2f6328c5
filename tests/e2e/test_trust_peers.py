"""What a peer, or a Flight caller, can make a real broker do, tried with fake peers.

A fake peer is a ``pyarrow.flight`` server in this process that announces
and streams whatever the test tells it: a stream that differs from its
announcement, a dtype this broker does not know, a tensor sent too slowly.
Whatever it sends, the pulling broker publishes a replica only under the
name it asked for, with the announced geometry and byte count, never in
place of a tensor published here, and reports the peer's fault as
``BrokerUnavailable`` naming the peer.  The broker's own Flight work (a
pull, a DoPut, a DoGet) outlives ``--session-ttl``; a DoPut is charged to
the token that pushes; and no Flight error carries a traceback or a path.
Every broker is checked for clean accounting and an empty /dev/shm at the
end (the ``broker_factory`` fixture).
"""

from __future__ import annotations

import gc
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import ROOT, BrokerProc, free_port, wait_for
from _hosts import flight_url
from _workerio import metrics
from tensordepot import BrokerUnavailable, Client, OutOfMemory

pa = pytest.importorskip("pyarrow")
fl = pytest.importorskip("pyarrow.flight")

MiB = 1 << 20
TOKEN = "peers-test-token-0123456789abcdef"
ENV = {"TENSORDEPOT_TOKEN": TOKEN}


def stream_schema(meta: dict[str, Any]) -> Any:
    return pa.schema([("bytes", pa.uint8())], metadata={b"tensordepot": json.dumps(meta).encode()})


def meta_of(name: str, shape: list[int], dtype: str, nbytes: int, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": 1,
        "shape": shape,
        "dtype": dtype,
        "nbytes": nbytes,
        "origin": "grpc://fake:1",
        "origin_instance": "fake",
        "origin_version": 1,
        **kw,
    }


class FakePeer(fl.FlightServerBase):  # type: ignore[misc]
    """A Flight server that announces ``meta`` and streams ``data`` in chunks
    of ``chunk`` bytes, ``pace`` seconds apart (a slow network), under the
    schema of ``sent`` (default: ``meta``).  With ``hold`` set, a stream
    starts only once the test calls ``release()``; ``started`` is set when
    a stream was asked for."""

    def __init__(
        self,
        meta: dict[str, Any],
        data: bytes,
        *,
        sent: dict[str, Any] | None = None,
        chunk: int = 4 * MiB,
        pace: float = 0.0,
        hold: bool = False,
    ) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.meta, self.data, self.sent = meta, data, sent or meta
        self.chunk, self.pace = chunk, pace
        self.started, self._go, self._quit = threading.Event(), threading.Event(), threading.Event()
        if not hold:
            self._go.set()
        self.url = f"grpc://127.0.0.1:{self.port}"

    def release(self) -> None:
        self._go.set()

    def close(self) -> None:
        self._quit.set()
        self._go.set()
        self.shutdown()

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        ticket = fl.Ticket(f"{self.meta['name']}@1".encode())
        return fl.FlightInfo(
            stream_schema(self.meta), descriptor, [fl.FlightEndpoint(ticket, [])], -1, -1
        )

    def do_get(self, context: Any, ticket: Any) -> Any:
        self.started.set()
        self._go.wait(60)
        sch = stream_schema(self.sent)
        return fl.GeneratorStream(sch, self._chunks(sch))

    def _chunks(self, sch: Any) -> Iterator[Any]:
        for off in range(0, max(len(self.data), 1), self.chunk):
            part = np.frombuffer(self.data[off : off + self.chunk], np.uint8)
            yield pa.record_batch([pa.array(part)], schema=sch)
            if self.pace and self._quit.wait(self.pace):  # the network's pace, not a wait for
                return  # a condition


@pytest.fixture
def fake_peer() -> Iterator[Callable[..., FakePeer]]:
    made: list[FakePeer] = []

    def make(*args: Any, **kw: Any) -> FakePeer:
        made.append(FakePeer(*args, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def empty_here(b: BrokerProc) -> None:
    """Nothing published, nothing allocated: the refused replica left no trace."""
    wait_for(
        lambda: (st := b.stat()).versions == 0 and st.bytes_in_use == 0,
        10,
        what="the refused replica's memory to be given back",
    )
    with b.client() as c:
        assert c.list() == []


F32 = np.arange(10, dtype=np.float32).tobytes()


def bearer(token: str) -> Any:
    return fl.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10
    )


def push(client: Any, name: str, token: str, meta: dict[str, Any], data: bytes) -> Any:
    sch = stream_schema(meta)
    writer, reader = client.do_put(fl.FlightDescriptor.for_path(name), sch, bearer(token))
    try:
        writer.write_batch(pa.record_batch([pa.array(np.frombuffer(data, np.uint8))], schema=sch))
        writer.done_writing()
        return reader.read()
    finally:
        writer.close()


READ_TOKEN = "read-token-peers-0123456789abcdef"


# -- 1. what is written is what was asked for, as announced ---------------------------------


@pytest.mark.parametrize(
    ("sent", "data"),
    [
        pytest.param({"shape": [5, 2]}, F32, id="other-shape"),
        pytest.param({"dtype": "int32"}, F32, id="other-dtype"),
        pytest.param({"name": "other"}, F32, id="other-name"),
        pytest.param({}, F32 + F32, id="more-bytes"),
        pytest.param({}, F32[:20], id="fewer-bytes"),
        pytest.param({"nbytes": 48}, F32, id="nbytes-not-the-shape"),
    ],
)
def test_a_stream_that_is_not_what_the_peer_announced_is_refused(
    sent: dict[str, Any],
    data: bytes,
    fake_peer: Callable[..., FakePeer],
    broker_factory: Callable[..., BrokerProc],
) -> None:
    announced = (
        {**meta_of("w", [10], "float32", 40), **sent}
        if "nbytes" in sent
        else meta_of("w", [10], "float32", 40)
    )
    peer = fake_peer(announced, data, sent={**announced, **sent})
    b = broker_factory("--peer", peer.url)
    with b.client() as c, pytest.raises(BrokerUnavailable) as err:
        c.get("w")
    assert f"peer {peer.url}" in str(err.value), err.value
    empty_here(b)


@pytest.mark.parametrize(
    "when",
    [
        pytest.param("written-before-the-get", id="written-before-the-get"),
        pytest.param("written-during-the-pull", id="written-during-the-pull"),
        pytest.param("published-during-the-pull", id="published-during-the-pull"),
    ],
)
def test_a_pull_never_replaces_a_tensor_written_here(
    when: str, fake_peer: Callable[..., FakePeer], broker_factory: Callable[..., BrokerProc]
) -> None:
    """The peer holds 'w' (zeros); this broker's own producer writes 'w'
    (sevens) before or while a get pulls it.  The local tensor wins: the get
    returns it, and the replica's memory is given back."""
    peer = fake_peer(meta_of("w", [10], "float32", 40), bytes(40), hold=True)
    b = broker_factory("--peer", peer.url)
    local = np.full(10, 7, dtype=np.float32)
    answer: dict[str, Any] = {}

    def getter() -> None:
        with b.client() as c:
            try:
                answer["got"] = np.from_dlpack(c.get("w", timeout=30)).copy()
            except Exception as exc:  # reported below, in the test's thread
                answer["error"] = exc

    with b.client() as producer:
        out = producer.empty("w", (10,), "float32") if when == "written-before-the-get" else None
        t = threading.Thread(target=getter)
        t.start()
        wait_for(
            lambda: peer.started.is_set() or b.stat().waiting,
            30,
            what="the get to pull from the peer, or to wait",
        )
        if when == "written-during-the-pull":
            out = producer.empty("w", (10,), "float32")
        if when == "published-during-the-pull":
            producer.put("w", local)
        else:
            assert out is not None
            np.from_dlpack(out)[...] = local
            if when == "written-before-the-get":
                out.publish()
        peer.release()
        if when == "written-during-the-pull":
            peer_url = peer.url
            wait_for(
                lambda: (
                    metrics(b.url).get(
                        f'tensordepot_peer_bytes_pulled_total{{peer="{peer_url}"}}', 0
                    )
                    == 40
                ),
                30,
                what="the pull to end",
            )
            out.publish()
        t.join(60)
        del out
    assert "error" not in answer, answer
    assert np.array_equal(answer["got"], local), "the peer's replica replaced the local tensor"
    with b.client() as c:
        [info] = c.list()
        assert (info.name, info.origin) == ("w", None), info
    wait_for(
        lambda: b.stat().versions == 1 and b.stat().bytes_in_use == 40,
        10,
        what="the dropped replica's memory to be given back",
    )


# -- 2. the broker's own Flight sessions never lapse ------------------------------------------


def test_the_brokers_own_flight_work_outlasts_the_session_ttl(
    fake_peer: Callable[..., FakePeer], broker_factory: Callable[..., BrokerProc]
) -> None:
    """A pull, a DoPut and a DoGet that each take several ``--session-ttl``
    and ``--alloc-ttl`` (1 s here) complete, and lapse nothing: the sessions
    they run in are the broker's own, ended by the broker when the work is
    done, and what they allocate is being written by the broker itself."""
    x = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
    peer = fake_peer(
        meta_of("slow", [4 * MiB], "uint8", 4 * MiB), x.tobytes(), chunk=64 * 1024, pace=0.05
    )  # 64 chunks: about 3 s
    b = broker_factory(
        "--session-ttl",
        "1",
        "--alloc-ttl",
        "1",
        "--peer",
        peer.url,
        "--peer-timeout",
        "5",
        "--flight",
        "grpc://127.0.0.1:0",
        env=ENV,
    )
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("slow", timeout=30)), x)  # the pull
    opts = fl.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {TOKEN}".encode())], timeout=60
    )
    with fl.connect(flight_url(b)) as client:
        meta = meta_of("pushed", [4 * MiB], "uint8", 4 * MiB)
        sch = stream_schema(meta)
        writer, reader = client.do_put(fl.FlightDescriptor.for_path("pushed"), sch, opts)
        paced = threading.Event()
        for off in range(0, 4 * MiB, 128 * 1024):  # 32 chunks, about 3 s
            writer.write_batch(pa.record_batch([pa.array(x[off : off + 128 * 1024])], schema=sch))
            paced.wait(0.1)  # the producer's pace
        writer.done_writing()
        assert json.loads(reader.read().to_pybytes())["version"] == 1
        writer.close()
        stream = client.do_get(fl.Ticket(b"pushed"), opts)  # the DoGet, read slowly
        got = []
        while True:
            try:
                got.append(stream.read_chunk().data.column(0).to_numpy())
            except StopIteration:
                break
            paced.wait(0.1)
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("pushed")), x)
    assert np.array_equal(np.concatenate(got), x)
    assert "missed its heartbeats" not in b.log(), b.log()
    st = b.stat()
    assert st.retired_total == 0, st


# -- 3. Flight errors carry one line, never a traceback ----------------------------------------


def test_flight_errors_carry_the_message_and_code_but_no_traceback(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{READ_TOKEN} read\n")
    tokens.chmod(0o600)
    b = broker_factory(
        "--flight",
        "grpc://127.0.0.1:0",
        "--token-file",
        str(tokens),
        "--segment-size",
        "4MiB",
        env=ENV,
        max_memory="8MiB",
    )
    with b.client() as c:
        c.put("w", np.arange(10, dtype=np.float32))
    good = meta_of("x", [10], "float32", 40)
    calls: list[tuple[str, bytes, Callable[[Any], Any]]] = [
        (
            "tensor 'nope' not found",
            b"not_found",
            lambda cl: cl.get_flight_info(fl.FlightDescriptor.for_path("nope"), bearer(TOKEN)),
        ),
        (
            "bad descriptor",
            b"invalid_request",
            lambda cl: cl.get_flight_info(fl.FlightDescriptor.for_command(b"w"), bearer(TOKEN)),
        ),
        (
            "bad ticket",
            b"invalid_request",
            lambda cl: cl.do_get(fl.Ticket(b"has space"), bearer(TOKEN)).read_all(),
        ),
        (
            "version 7 of 'w' is not the newest",
            b"not_found",
            lambda cl: cl.do_get(fl.Ticket(b"w@7"), bearer(TOKEN)).read_all(),
        ),
        (
            "unknown dtype 'float99'",
            b"invalid_request",
            lambda cl: push(cl, "x", TOKEN, {**good, "dtype": "float99"}, bytes(40)),
        ),
        ("carried 20 bytes", b"invalid_request", lambda cl: push(cl, "x", TOKEN, good, bytes(20))),
        (
            "more than the 40 bytes",
            b"invalid_request",
            lambda cl: push(cl, "x", TOKEN, good, bytes(80)),
        ),
        ("needs 'write'", b"forbidden", lambda cl: push(cl, "x", READ_TOKEN, good, bytes(40))),
        (
            "cannot place 'x'",
            b"out_of_memory",
            lambda cl: push(
                cl, "x", TOKEN, meta_of("x", [16 * MiB], "uint8", 16 * MiB), bytes(16 * MiB)
            ),
        ),
    ]
    with fl.connect(flight_url(b)) as client:
        for message, code, call in calls:
            with pytest.raises(pa.ArrowException) as err:
                call(client)
            text = str(err.value)
            assert message in text, text
            for leak in ("Traceback", 'File "', ".py", str(ROOT), "site-packages"):
                assert leak not in text, f"{message!r}: {text!r}"
            assert getattr(err.value, "extra_info", None) == code, (message, text)
    wait_for(lambda: b.stat().versions == 1, 10, what="refused pushes to be given back")


# -- 4. a peer's fault is the peer's, and says what it was ------------------------------------


@pytest.mark.parametrize(
    ("meta", "cause"),
    [
        pytest.param(meta_of("w", [10], "float99", 40), "unknown dtype 'float99'", id="dtype"),
        pytest.param(meta_of("w", [1 << 40, 1 << 40], "float32", 0), "overflows", id="shape"),
    ],
)
def test_a_peers_bad_announcement_is_the_peers_fault(
    meta: dict[str, Any],
    cause: str,
    fake_peer: Callable[..., FakePeer],
    broker_factory: Callable[..., BrokerProc],
) -> None:
    peer = fake_peer(meta, bytes(40))
    b = broker_factory("--peer", peer.url)
    with b.client() as c, pytest.raises(BrokerUnavailable) as err:
        c.get("w")
    assert f"peer {peer.url}" in str(err.value) and cause in str(err.value), err.value
    empty_here(b)


def test_a_transfer_past_its_whole_deadline_says_so(
    fake_peer: Callable[..., FakePeer], broker_factory: Callable[..., BrokerProc]
) -> None:
    """--peer-timeout 1 bounds each quiet spell, and the whole transfer of
    1 MiB gets 1 s plus 1 s per MiB: a peer that keeps sending, too slowly,
    is cut off at 2 s, and the message says it was the whole transfer."""
    peer = fake_peer(meta_of("w", [MiB], "uint8", MiB), bytes(MiB), chunk=32 * 1024, pace=0.2)
    b = broker_factory("--peer", peer.url, "--peer-timeout", "1")
    with b.client() as c, pytest.raises(BrokerUnavailable) as err:
        c.get("w")
    msg = str(err.value)
    assert f"peer {peer.url}" in msg and "within 2 s" in msg, msg
    assert "did not answer" not in msg and "whole transfer" in msg, msg
    empty_here(b)


def test_out_of_memory_on_a_push_is_out_of_memory(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    a = broker_factory(env=ENV)
    b = broker_factory(
        "--flight", "grpc://127.0.0.1:0", "--segment-size", "4MiB", env=ENV, max_memory="8MiB"
    )
    with a.client() as c:
        c.put("big", np.zeros(16 * MiB, dtype=np.uint8))
        with pytest.raises(OutOfMemory) as err:
            c.push("big", flight_url(b), token=TOKEN)
        # The error holds no view of the tensor: its lease goes now, with no collection.
        gc.disable()
        try:
            wait_for(lambda: c.stat().leases == 0, 10, what="the failed push's lease to go")
        finally:
            gc.enable()
    assert flight_url(b) in str(err.value) and "cannot place 'big'" in str(err.value), err.value
    empty_here(b)


# -- 5. a push is charged to the token that pushes ----------------------------------------------


def test_flight_pushes_are_charged_to_the_pushing_tokens_quota(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    one, two = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{one} write name=one\n{two} write name=two\n")
    tokens.chmod(0o600)
    port = free_port()
    b = broker_factory(
        "--flight",
        "grpc://127.0.0.1:0",
        "--listen",
        f"http://127.0.0.1:{port}",
        "--token-file",
        str(tokens),
        "--max-memory-per-token",
        "20MiB",
        env=ENV,
    )
    x = bytes(16 * MiB)
    meta = meta_of("a", [16 * MiB], "uint8", 16 * MiB)
    with fl.connect(flight_url(b)) as client:
        assert push(client, "a", one, meta, x) is not None
        with pytest.raises(pa.ArrowException) as err:
            push(client, "b", one, {**meta, "name": "b"}, x)  # 32 MiB under a 20 MiB quota
        assert "--max-memory-per-token" in str(err.value) and "token:one" in str(err.value)
        assert getattr(err.value, "extra_info", None) == b"out_of_memory", err.value
        st = b.stat()
        assert (st.versions, st.bytes_in_use) == (1, 16 * MiB), st  # nothing left allocated
        assert push(client, "c", two, {**meta, "name": "c"}, x) is not None  # not locked out
    # One quota rule, whatever the door: the same token's HTTP put is refused too.
    with Client(f"http://127.0.0.1:{port}", token=one) as c:
        with pytest.raises(OutOfMemory, match="--max-memory-per-token"):
            c.put("d", np.zeros(8 * MiB, dtype=np.uint8))
        c.delete("a")
        c.put("d", np.zeros(8 * MiB, dtype=np.uint8))  # its bytes came back with the delete


# -- 6. replicas are charged to the reader who pulled them, and are a cache ---------------------


def test_replicas_are_charged_to_their_reader_and_dropped_for_room(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    """A read token's gets pull replicas here: they count against that token,
    not against an identity every reader shares, and a replica no lease
    holds is a cache, dropped (least recently checked first) when its
    reader's quota or the broker's memory needs the room."""
    a = broker_factory("--flight", "grpc://127.0.0.1:0", env=ENV)
    with a.client() as c:
        for n in "abc":
            c.put(n, np.full(8 * MiB, ord(n), np.uint8))
    one, two, writer = (secrets.token_urlsafe(24) for _ in range(3))
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{one} read name=one\n{two} read name=two\n{writer} write name=w\n")
    tokens.chmod(0o600)
    url = f"http://127.0.0.1:{free_port()}"
    b = broker_factory(
        "--peer",
        flight_url(a),
        "--peer-token",
        TOKEN,
        "--listen",
        url,
        "--token-file",
        str(tokens),
        "--max-memory-per-token",
        "20MiB",
        "--segment-size",
        "4MiB",
        "--warm-memory",
        "0",
        max_memory="32MiB",
    )
    with Client(url, token=one) as r1, Client(url, token=two) as r2, Client(url, token=writer) as w:
        for n in "ab":
            assert int(np.from_dlpack(r1.get(n))[0]) == ord(n)
        wait_for(lambda: r1.stat().leases == 0, 10, what="r1's leases to end")
        # 16 MiB of r1's replicas, and 8 more would pass its 20 MiB: its own
        # cached replica makes room, where a shared quota said 507.
        assert int(np.from_dlpack(r1.get("c"))[0]) == ord("c")
        assert int(np.from_dlpack(r2.get("a"))[0]) == ord("a")  # charged to two, not one
        wait_for(lambda: r1.stat().leases == 0, 10, what="the leases to end")
        assert r1.stat().bytes_in_use == 24 * MiB
        w.put("own", np.zeros(16 * MiB, np.uint8))  # replicas give way to a put
        st = w.stat()
        assert st.bytes_in_use <= 32 * MiB and "own" in {i.name for i in w.list()}
        assert metrics(b.url).get("tensordepot_replicas_evicted_total", 0) >= 2
        assert int(np.from_dlpack(r1.get("b"))[0]) == ord("b")  # pulled again on demand
