"""The client core against a fake transport (in the manner of httpx's
``MockTransport`` tests): operations are steps, so a test answers each
request itself and sees exactly what went out, with no broker and no
socket.  What a real broker does with these requests is tested end to end
in tests/e2e/."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from tensordepot import AsyncClient, BrokerUnavailable, TensorBroken, TensorNotFound
from tensordepot._proto import unframe
from tensordepot._wire import BatchGet, ManyAlloc, ManyPublish, PublishRequest
from tensordepot.client import _batch, _http, _ops
from tensordepot.client._core import Core
from tensordepot.client._http import Failure, Offload, Op, Request

SESSION = "x-tensordepot-session"
REQUEST = "x-tensordepot-request"
RELEASE = "x-tensordepot-release"
CANCEL = "x-tensordepot-cancel"
BROKER = [("x-tensordepot-broker", "1")]


class Sent:
    """One request as it went out: method, path, headers, body."""

    def __init__(self, req: Request) -> None:
        lines = req.head.decode("latin-1").split("\r\n")
        self.method, self.path, _ = lines[0].split(" ")
        self.headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines[1:] if ln)}
        self.body = req.body
        self.fresh = req.fresh

    @property
    def route(self) -> str:
        return self.path.split("?")[0]

    def json(self) -> Any:
        assert self.headers["content-type"] == "application/json"
        return json.loads(self.body)


Answer = tuple[int, bytes]
Handler = Callable[[Sent], Answer]


def ok(body: Any = None, status: int = 200) -> Answer:
    return status, b"" if body is None else json.dumps(body).encode()


def refused(code: str, status: int = 409) -> Answer:
    return ok({"error": {"code": code, "message": code}}, status)


class FakeTransport:
    """Answers each request with ``handler``; records what was sent.  A
    handler may raise ``Failure`` (the connection was cut)."""

    timeout = 5.0

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sent: list[Sent] = []
        self.sessions = 0

    def roundtrip(self, req: Request) -> Answer:
        sent = Sent(req)
        self.sent.append(sent)
        if sent.route == "/v1/sessions" and sent.method == "POST":
            self.sessions += 1
            return ok(
                {
                    "session": f"s{self.sessions}",
                    "pid": 1,
                    "tracked": True,
                    "heartbeat_interval": None,
                }
            )
        if sent.route.startswith("/v1/sessions/") and sent.method == "DELETE":
            return ok(status=204)
        return self.handler(sent)

    def after_fork(self) -> None:
        pass

    def close(self) -> None:
        pass

    def routes(self) -> list[str]:
        return [f"{s.method} {s.route}" for s in self.sent]


@pytest.fixture
def fake() -> Iterator[Callable[[Handler], tuple[Core, FakeTransport]]]:
    made: list[Core] = []

    def make(handler: Handler) -> tuple[Core, FakeTransport]:
        transport = FakeTransport(handler)
        core = Core(
            "unix:///nowhere/broker.sock",
            token=None,
            timeout=5.0,
            label=None,
            trust_uid=None,
            transport=lambda *a, **kw: transport,
            open=True,
        )
        assert core.bg is not None
        core.bg.stop()  # its queues stay; only the tests' requests carry them
        core.bg._r, core.bg._w = os.pipe()  # where later wake-ups go (closed with the core)
        made.append(core)
        return core, transport

    yield make
    for core in made:
        core.close()


def run(
    op: Op[Any], transport: FakeTransport, offload: Callable[[Offload], Any] = lambda step: None
) -> Any:
    """A driver for tests: requests go to ``transport``; ``offload`` stands in
    for the work an operation offloads (a copy, a mapping)."""
    try:
        step = next(op)
        while True:
            try:
                result = transport.roundtrip(step) if isinstance(step, Request) else offload(step)
            except BaseException as exc:
                step = op.throw(exc)
            else:
                step = op.send(result)
    except StopIteration as stop:
        return stop.value


HANDLE = {
    "name": "w",
    "version": 3,
    "kind": "posix",
    "segment": "seg",
    "offset": 0,
    "nbytes": 16,
    "shape": [4],
    "strides": [1],
    "dtype": "float32",
    "device": "cpu",
    "state": "ready",
    "lease": 9,
}


def test_a_get_of_an_unknown_session_reopens_it_and_resends_once(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def handler(s: Sent) -> Answer:
        if s.headers[SESSION] == "s1":
            return refused("unknown_session")
        return ok(HANDLE)

    core, t = fake(handler)
    mapped: list[Any] = []
    monkeypatch.setattr(_ops, "tensor", lambda core, h, writable: mapped.append(h) or "tensor")
    got = run(_ops.get(core, "w", 0, 0), t)
    assert got == "tensor" and [h.lease for h in mapped] == [9]
    gets = [s for s in t.sent if s.method == "GET"]
    assert [s.headers[SESSION] for s in gets] == ["s1", "s2"]
    assert gets[0].headers[REQUEST] == gets[1].headers[REQUEST]  # the same request, once more
    assert t.routes() == [
        "POST /v1/sessions",
        "GET /v1/tensors/w",
        "POST /v1/sessions",
        "GET /v1/tensors/w",
    ]
    assert core.sid == "s2"


def test_a_second_unknown_session_is_an_error_not_a_loop(fake: Any) -> None:
    core, t = fake(lambda s: refused("unknown_session"))
    with pytest.raises(Exception, match="unknown_session"):
        run(_ops.stat(core), t)
    assert t.routes().count("GET /v1/stat") == 2


def test_riders_ride_on_the_next_request_and_only_once(fake: Any) -> None:
    core, t = fake(lambda s: ok({"items": []}))
    core.bg.release_later(core.sid, 5)
    core.bg.release_later(core.sid, 6)
    core.bg.cancel_later(core.sid, "r1")
    core.bg.release_later("an-old-session", 7)  # never sent under another session's id
    run(_ops.names(core), t)
    run(_ops.names(core), t)
    first, second = t.sent[-2:]
    assert (first.headers[RELEASE], first.headers[CANCEL]) == ("5,6", "r1")
    assert RELEASE not in second.headers and CANCEL not in second.headers


def test_riders_of_a_request_that_was_never_answered_go_out_again(fake: Any) -> None:
    answers: list[Answer | None] = [None, None]  # both attempts of the first request fail

    def handler(s: Sent) -> Answer:
        if answers:
            answers.pop()
            raise Failure(ConnectionResetError("cut"), reused=True)
        return ok({"items": []})

    core, t = fake(handler)
    core.bg.release_later(core.sid, 5)
    with pytest.raises(BrokerUnavailable):
        run(_ops.names(core), t)
    run(_ops.names(core), t)
    assert [s.headers.get(RELEASE) for s in t.sent[-3:]] == ["5", "5", "5"]


def test_a_resend_after_a_cut_connection_carries_the_same_request_id(fake: Any) -> None:
    cuts = [1]

    def handler(s: Sent) -> Answer:
        if cuts:
            cuts.pop()
            raise Failure(ConnectionResetError("cut mid-answer"), reused=True)
        return ok(status=204)

    core, t = fake(handler)
    run(_ops.delete(core, "w"), t)
    first, again = t.sent[-2:]
    assert (first.route, again.route) == ("/v1/tensors/w", "/v1/tensors/w")
    assert first.headers[REQUEST] == again.headers[REQUEST] and again.fresh and not first.fresh


def test_a_post_without_a_request_id_is_never_resent(fake: Any) -> None:
    def handler(s: Sent) -> Answer:
        raise Failure(ConnectionResetError("cut"), reused=True)

    core, t = fake(handler)
    with pytest.raises(BrokerUnavailable):
        run(core.call("POST", "/v1/sessions/x/claim"), t)
    assert t.routes().count("POST /v1/sessions/x/claim") == 1


def test_a_get_never_answered_cancels_what_it_was_granted(fake: Any) -> None:
    def handler(s: Sent) -> Answer:
        if s.method == "GET":
            raise KeyboardInterrupt  # Ctrl-C while it waits
        return ok({"released": 0})

    core, t = fake(handler)
    with pytest.raises(KeyboardInterrupt):
        run(_ops.get(core, "w", None, 0), t)
    rid = t.sent[-1].headers[REQUEST]
    assert list(core.bg.cancels) == [(core.sid, rid)]


# 64 KiB and 16 bytes: on average more than INLINE_BATCH_MEAN, so the bytes are not inline.
COLUMNS = {
    "names": ["a", "b"],
    "versions": [1, 4],
    "state": "writing",
    "segments": ["seg"],
    "packs": [[0, 0, 65536, None], [0, 65536, 256, None]],
    "pack": [0, 1],
    "at": [0, 0],
    "layouts": [[[16384], "float32", 65536], [[4], "float32", 16]],
    "layout": [0, 1],
}


def test_put_many_allocates_and_publishes_over_the_many_routes(fake: Any) -> None:
    core, t = fake(lambda s: ok(COLUMNS) if s.route == "/v1/many/alloc" else ok({}))
    sd = {"a": np.zeros(16384, dtype=np.float32), "b": np.ones(4, dtype=np.float32)}
    copies: list[Offload] = []
    assert run(_batch.put_many(core, sd, None, None), t, copies.append) == {"a": 1, "b": 4}
    assert t.routes()[1:] == ["POST /v1/many/alloc", "POST /v1/many/publish"]
    alloc, publish = (s.json() for s in t.sent[1:])
    assert ManyAlloc.model_validate(alloc) == ManyAlloc(
        names=["a", "b"], shapes=[[16384], [4]], dtypes=["float32", "float32"], ttl=None
    )
    assert ManyPublish.model_validate(publish) == ManyPublish(names=["a", "b"], versions=[1, 4])
    assert len(copies) == 1 and not copies[0].cheap  # the copy is offloaded work
    assert all(s.headers.get(REQUEST) for s in t.sent[1:])


def test_put_many_of_small_tensors_carries_their_bytes_in_one_request(fake: Any) -> None:
    core, t = fake(lambda s: ok({"names": ["a", "b", "c"], "versions": [2, 7, 1]}))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    sd = {"a": a.T, "b": np.ones(4, dtype=np.int64), "c": a.T}  # a.T: C order is a copy
    assert run(_batch.put_many(core, sd, 5.0, None), t) == {"a": 2, "b": 7, "c": 1}
    assert t.routes()[1:] == ["POST /v1/many/put"]
    (sent,) = t.sent[1:]
    assert sent.headers["content-type"] == "application/octet-stream" and sent.headers[REQUEST]
    head, rest = unframe(sent.body)
    assert ManyAlloc.model_validate_json(head) == ManyAlloc(
        names=["a", "b", "c"],
        shapes=[[3, 2], [4], [3, 2]],
        dtypes=["float32", "int64", "float32"],
        ttl=5.0,
        same=[-1, -1, 0],
    )
    # c is a's very bytes: sent once
    assert bytes(rest) == np.ascontiguousarray(a.T).tobytes() + sd["b"].tobytes()


def test_a_put_many_answer_without_a_version_per_tensor_is_refused(fake: Any) -> None:
    core, t = fake(lambda s: ok({"names": ["a"], "versions": [1]}))
    with pytest.raises(TensorBroken, match="one version per tensor"):
        run(
            _batch.put_many(
                core, {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, None, None
            ),
            t,
        )


def test_put_many_whose_copy_fails_gives_every_allocation_back(fake: Any) -> None:
    core, t = fake(lambda s: ok(COLUMNS) if s.route == "/v1/many/alloc" else ok({}))

    def copy(step: Offload) -> None:
        raise MemoryError("the copy failed")

    with pytest.raises(MemoryError):
        run(
            _batch.put_many(
                core, {"a": np.zeros(16384, np.float32), "b": np.ones(4, np.float32)}, None, None
            ),
            t,
            copy,
        )
    aborts = [PublishRequest.model_validate(s.json()) for s in t.sent if s.route == "/v1/abort"]
    assert [(a.name, a.version) for a in aborts] == [("a", 1), ("b", 4)]
    assert "POST /v1/many/publish" not in t.routes()


def test_get_many_asks_once_over_the_many_route(fake: Any) -> None:
    core, t = fake(lambda s: refused("not_found", 404))
    with pytest.raises(TensorNotFound):
        run(_batch.get_many(core, ["a", "b"], 1.5, {"b": 2}), t)
    (sent,) = [s for s in t.sent if s.route == "/v1/many/get"]
    assert BatchGet.model_validate(sent.json()) == BatchGet(
        names=["a", "b"], timeout=1.5, newer_than=[0, 2]
    )


def test_small_puts_carry_their_bytes_and_large_ones_allocate(fake: Any) -> None:
    handle = dict(HANDLE, state="writing", lease=None, nbytes=1 << 20, shape=[1 << 18])
    core, t = fake(lambda s: ok(handle) if s.route == "/v1/alloc" else ok({"version": 3}))
    assert run(_ops.put(core, "w", np.arange(4, dtype=np.float32), None, None), t) == 3
    inline = t.sent[-1]
    assert inline.route == "/v1/put/w" and inline.body == np.arange(4, dtype=np.float32).tobytes()
    assert inline.headers["content-type"] == "application/octet-stream"
    assert run(_ops.put(core, "w", np.zeros(1 << 18, np.float32), None, None), t) == 3
    assert t.routes()[-2:] == ["POST /v1/alloc", "POST /v1/publish"]


class AsyncFake:
    """The AsyncClient's transport, answering like ``FakeTransport``; a
    request to ``hold`` waits until ``release`` is set."""

    def __init__(self, handler: Handler, hold: str) -> None:
        self.sync = FakeTransport(handler)
        self.hold = hold
        self.release = asyncio.Event()
        self.held = asyncio.Event()

    async def roundtrip(self, req: Request) -> Answer:
        if Sent(req).route == self.hold:
            self.held.set()
            await self.release.wait()
        return self.sync.roundtrip(req)

    def close(self) -> None:
        pass

    def after_fork(self) -> None:
        pass


def test_a_put_cancelled_while_it_allocates_gives_the_allocation_back() -> None:
    """The caller raises at once; the allocation, answered later, is aborted,
    never filled or published."""
    handle = dict(HANDLE, state="writing", lease=None, nbytes=1 << 20, shape=[1 << 18])

    async def main() -> list[str]:
        c = AsyncClient("unix:///nowhere/broker.sock")
        fake = AsyncFake(
            lambda s: ok(handle) if s.route == "/v1/alloc" else ok(status=204), hold="/v1/alloc"
        )
        c._transport = fake  # type: ignore[assignment]
        task = asyncio.ensure_future(c.put("w", np.zeros(1 << 18, np.float32)))
        await asyncio.wait_for(fake.held.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "POST /v1/abort" not in fake.sync.routes()  # nothing to give back yet
        fake.release.set()
        await asyncio.wait_for(asyncio.gather(*c._pending), 5)  # the rest of the put
        routes = fake.sync.routes()
        await c.aclose()
        return routes

    routes = asyncio.run(main())
    assert routes == ["POST /v1/sessions", "POST /v1/alloc", "POST /v1/abort"]


def test_ctrl_c_while_an_answer_is_parsed_is_ctrl_c_not_a_bad_answer() -> None:
    """A SIGINT that lands while httptools calls back into the client (the
    parser wraps what a callback raises) reaches the caller as
    KeyboardInterrupt, never as 'not a tensordepot broker'."""
    chunks = b"".join(b"1\r\nx\r\n" for _ in range(2_000_000))  # the body in 1-byte chunks
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)  # lands while feed_data parses
        with pytest.raises(KeyboardInterrupt):
            _http.Answer().feed(raw)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
