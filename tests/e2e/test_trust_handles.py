"""What the client believes of a broker, and what it takes from its caller.

A handle whose geometry reaches outside its bytes or its segment is refused
with ``TensorBroken`` before anything is mapped, and its lease is given back
(a fake broker on a unix socket hands out crafted handles into a real
segment made with the project's shm code); a put of a tensor held from a
broker that was killed and restarted copies it, the first time; a masked
numpy array is refused, whatever its size, by both clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import numpy as np
import pytest
from _harness import TEST_PREFIX, WORKERS, BrokerProc, drained, shm_entries
from tensordepot import AsyncClient, InvalidRequest
from tensordepot.shm._posix import PosixSegment

MiB = 1 << 20


# -- handles that reach outside their bytes ----------------------------------------------------

SIZE = MiB  # the fake broker's one segment
BIG = 1 << 17  # float32 elements of a put's tensor (handle_taker.py): 512 KiB, not inline
# Each lie, as what it changes in a true handle; None: a handle's strides (batches have none).
LIES: dict[str, dict[str, Any] | None] = {
    "shape-past-nbytes": {"shape": "twice"},
    "shape-past-segment": {"shape": [SIZE]},
    "strides-past-nbytes": {"strides": [2]},
    "negative-strides": {"strides": [-1]},
    "offset-past-segment": {"offset": SIZE - 8},
    "negative-offset": {"offset": -4096},
    "nbytes-past-segment": {"nbytes": SIZE, "shape": [SIZE // 4]},
    "unknown-dtype": {"dtype": "float33"},
    "segment-not-a-name": {"segment": "../../etc/passwd"},
    "uneven-columns": {"columns": {"at": [0, 0]}},
    "pack-index-past-packs": {"columns": {"pack": [3]}},
    "layout-index-past-layouts": {"columns": {"layout": [1]}},
    "segment-index-past-segments": {"columns": {"packs": "segment 3"}},
    "at-past-pack": {"columns": {"at": [64]}},
    "not-a-handle": {"shape": "x"},  # given back by its request id: no lease id can be read
}
BATCHES = ("get_many", "put_many")
# A get_many's answer that leaves out the columns the client keeps (client/_known.py),
# each lie as what it changes in a true short answer; the first answer, whole, is true.
KEY = 7
SHORT_LIES: dict[str, dict[str, Any]] = {
    "short-pack-too-small": {"packs": "too small"},
    "short-versions-uneven": {"versions": [1, 1]},
    "short-key-not-ours": {"key": KEY + 1},
    "short-two-segments": {"segments": "twice"},
    "short-unasked": {"key": KEY, "unasked": True},
}


def _lies(op: str) -> list[str]:
    return [
        k
        for k, lie in LIES.items()
        if (op in BATCHES or "columns" not in (lie or {}))
        and not (op in BATCHES and "strides" in (lie or {}))
    ]


class FakeBroker:
    """An HTTP server on a unix socket that answers the client's requests as
    a broker would, with a crafted handle per name into a real segment (made
    here with the project's shm code), and records what the client gives
    back: releases (on their own, or riding on a request) and aborts."""

    def __init__(self, sock: str, segment: str) -> None:
        self.segment = segment
        self.lock = threading.Lock()
        self.released: list[int] = []
        self.aborted: list[str] = []
        self.published: list[Any] = []
        self.cancelled: list[str] = []  # request ids
        self.granted: dict[str, str] = {}  # name -> the id of the request that got its handle
        self.ended = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.answer(self)

            do_POST = do_DELETE = do_GET

        self.server = socketserver.ThreadingUnixStreamServer(sock, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    @staticmethod
    def lease(name: str) -> int:
        if name in SHORT_LIES:
            return 200 + list(SHORT_LIES).index(name)
        return 100 + list(LIES).index(name)

    def short(self, name: str, known: bool) -> dict[str, Any]:
        """The answer to a get_many of ``name``: whole, with its key, the
        first time (or, for "short-unasked", short without being asked);
        short, with its lie, when the client names the key (``known``)."""
        lie = SHORT_LIES[name]
        cols = dict(self.columns(name, "ready", True, False), key=KEY)
        cols["packs"] = [[0, 4096, 16, self.lease(name) + (100 if known else 0)]]
        if not known and not lie.get("unasked"):
            return cols
        cols.update(names=[], pack=[], at=[], layouts=[], layout=[])
        for key, value in lie.items():
            if key == "packs":
                cols["packs"] = [[0, 4096, 8, cols["packs"][0][3]]]
            elif key == "segments":
                cols["segments"] = [self.segment, self.segment]
            elif key != "unasked":
                cols[key] = value
        return cols

    def handle(self, name: str, state: str, lease: int | None, big: bool) -> dict[str, Any]:
        n = BIG if big else 4
        h: dict[str, Any] = {
            "name": name,
            "version": 1,
            "kind": "posix",
            "segment": self.segment,
            "offset": 4096,
            "nbytes": 4 * n,
            "shape": [n],
            "strides": [1],
            "dtype": "float32",
            "device": "cpu",
            "state": state,
            "lease": lease,
        }
        for key, value in (LIES.get(name) or {}).items():
            h[key] = [2 * n] if value == "twice" else value
        return h

    def columns(self, name: str, state: str, leases: bool, big: bool) -> dict[str, Any]:
        h = self.handle(name, state, None, big)
        cols = {
            "names": [name],
            "versions": [1],
            "state": state,
            "segments": [h["segment"]],
            "packs": [[0, h["offset"], h["nbytes"], self.lease(name) if leases else None]],
            "pack": [0],
            "at": [0],
            "layouts": [[h["shape"], h["dtype"], h["nbytes"]]],
            "layout": [0],
        }
        cols.update(h.get("columns", {}))
        if cols["packs"] == "segment 3":
            cols["packs"] = [[3, h["offset"], h["nbytes"], self.lease(name) if leases else None]]
        return cols

    def route(self, method: str, path: str, body: Any, query: str = "") -> tuple[int, Any]:
        if (method, path) == ("POST", "/v1/sessions"):
            return 200, {
                "session": "fake",
                "pid": None,
                "tracked": False,
                "heartbeat_interval": None,
            }
        if method == "DELETE" and path == "/v1/sessions/fake":
            self.ended += 1
            return 204, None
        if method == "GET" and path.startswith("/v1/tensors/"):
            name = path.rsplit("/", 1)[1]
            return 200, self.handle(name, "ready", self.lease(name), False)
        if path == "/v1/alloc":
            name = body["name"]
            return 200, self.handle(
                name, "writing", self.lease(name) if body["hold"] else None, not body["hold"]
            )
        if path == "/v1/many/get" and body["names"][0] in SHORT_LIES:
            return 200, self.short(body["names"][0], query == f"known={KEY}")
        if path == "/v1/many/get":
            return 200, self.columns(body["names"][0], "ready", True, False)
        if path == "/v1/many/alloc":
            return 200, self.columns(body["names"][0], "writing", False, True)
        if path == "/v1/abort":
            self.aborted.append(body["name"])
            return 204, None
        if path == "/v1/release":
            self.released += body["leases"]
            self.cancelled += body["requests"]
            return 204, None
        if path in ("/v1/publish", "/v1/many/publish"):
            self.published.append(body)
            return 200, {"version": 1}
        return 404, {"error": {"code": "not_found", "message": f"{method} {path}"}}

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("content-length") or 0)
        body = json.loads(h.rfile.read(n)) if n else None
        riders = h.headers.get("x-tensordepot-release")
        cancels = h.headers.get("x-tensordepot-cancel")
        with self.lock:
            self.released += [int(i) for i in riders.split(",")] if riders else []
            self.cancelled += cancels.split(",") if cancels else []
            path, _, query = h.path.partition("?")
            status, out = self.route(h.command, path, body, query)
            if isinstance(out, dict) and ("names" in out or "kind" in out):  # a handle
                name = body["names"][0] if "names" in out else out["name"]
                self.granted[name] = h.headers["x-tensordepot-request"]
        data = b"" if out is None else json.dumps(out).encode()
        h.send_response(status)
        h.send_header("x-tensordepot-broker", "fake")
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeBroker]]:
    prefix = f"{TEST_PREFIX}fake-{secrets.token_hex(4)}-"
    seg = PosixSegment(prefix + "0", SIZE)
    where = tempfile.mkdtemp(prefix="td-", dir="/tmp")
    sock = os.path.join(where, "broker.sock")
    broker = FakeBroker(sock, seg.name)
    try:
        yield "unix://" + sock, broker
    finally:
        broker.close()
        seg.unlink()
        shutil.rmtree(where, ignore_errors=True)
        assert shm_entries(prefix) == []


def _all_refused(url: str, driver: str, op: str, lies: list[str]) -> None:
    """handle_taker.py takes each of ``lies`` with ``op``: each is refused
    with TensorBroken, and the client lives on."""
    res = subprocess.run(
        [sys.executable, str(WORKERS / "handle_taker.py"), url, driver, op, *lies],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = {r["name"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert res.returncode == 0, (
        f"the client died ({res.returncode}) after {list(said)}:\n{res.stderr[-2000:]}"
    )
    wrong = {
        name: (r["raised"], r["message"])
        for name, r in said.items()
        if r["raised"] != "TensorBroken"
    }
    assert not wrong and list(said) == lies, wrong
    for r in said.values():
        assert "refusing the broker's handle" in r["message"], r


@pytest.mark.parametrize(
    "op,driver",
    [
        pytest.param("get", "sync", id="get"),
        pytest.param("get", "async", id="async-get"),
        pytest.param("get_many", "sync", id="get_many"),
        pytest.param("get_many", "async", id="async-get_many"),
        pytest.param("empty", "sync", id="empty"),
        pytest.param("empty", "async", id="async-empty"),
        pytest.param("put", "sync", id="put"),
        pytest.param("put_many", "async", id="async-put_many"),
    ],
)
def test_a_handle_reaching_outside_its_bytes_is_refused_and_given_back(
    fake: tuple[str, FakeBroker], op: str, driver: str
) -> None:
    url, broker = fake
    lies = _lies(op)
    _all_refused(url, driver, op, lies)
    # What the broker handed out came back, before the session ended: by its
    # lease or allocation, or (an answer that names none) by its request id.
    assert broker.ended == 1 and broker.published == []
    assert broker.cancelled == [broker.granted["not-a-handle"]]
    lies.remove("not-a-handle")
    if op in ("put", "put_many"):
        assert sorted(broker.aborted) == sorted(lies)
    else:
        assert sorted(broker.released) == sorted(broker.lease(name) for name in lies)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_short_answer_that_lies_is_refused_and_given_back(
    fake: tuple[str, FakeBroker], driver: str
) -> None:
    """A get_many answered whole with a key, then again without its columns
    (the client named the key): an answer whose versions, segments or pack
    do not fit the columns kept, or that names a key not kept, or that is
    short unasked, is refused with TensorBroken, and both leases come back."""
    url, broker = fake
    lies = list(SHORT_LIES)
    _all_refused(url, driver, "get_many_again", lies)
    firsts = [broker.lease(n) for n in lies if n != "short-unasked"]
    shorts = [broker.lease(n) + 100 for n in lies if n != "short-unasked"]
    assert sorted(broker.released) == sorted([*firsts, *shorts, broker.lease("short-unasked")])
    assert broker.ended == 1 and broker.cancelled == []


# -- a re-put after the broker restarted ---------------------------------------------------------


def _restart(b: BrokerProc) -> None:
    """SIGKILL the broker, and start a new one on the same socket and prefix."""
    b.kill()
    b.start()


def _expected() -> dict[str, Any]:
    return {"small": np.arange(100.0), "big": np.arange(MiB, dtype=np.float32)}


def test_a_tensor_held_from_a_killed_broker_is_copied_by_the_first_put(broker: BrokerProc) -> None:
    want = _expected()
    with broker.client() as c:
        c.put_many(want)
        held = {
            "big": c.get("big"),
            **{f"many-{k}": v for k, v in c.get_many(["small", "big"]).items()},
        }
        _restart(broker)
        for key, t in held.items():
            assert c.put(f"again-{key}", t) >= 1  # the first put after the restart
        got = c.get_many([f"again-{key}" for key in held])
        for key, t in held.items():
            assert np.array_equal(np.from_dlpack(got[f"again-{key}"]), want[t.name])
        assert c.stat().tensors == len(held)
        del got, held, t

    async def main() -> None:
        async with AsyncClient(broker.url) as ac:
            await ac.put_many(want)
            many = await ac.get_many(["small"])
            held = {"big": await ac.get("big"), "many-small": many.pop("small")}
            await asyncio.get_running_loop().run_in_executor(None, _restart, broker)
            for key, t in held.items():
                assert await ac.put(f"again-{key}", t) >= 1
            for key, t in held.items():
                got = await ac.get(f"again-{key}")
                assert np.array_equal(np.from_dlpack(got), want[t.name])
            del got, held, t

    asyncio.run(main())
    drained(broker, "leases", "waiting")


# -- masked arrays ------------------------------------------------------------------------------


def masked(n: int) -> Any:
    data = np.arange(n, dtype=np.float32)
    return np.ma.masked_array(data, mask=data % 2 == 0, fill_value=-1.0)


def _puts(c: Any, x: Any) -> list[Callable[[], Any]]:
    return [lambda: c.put("m", x), lambda: c.put_many({"ok": np.zeros(3), "m": x})]


@pytest.mark.parametrize("n", [pytest.param(1000, id="inline"), pytest.param(MiB, id="alloc")])
def test_a_masked_array_is_refused_by_put_and_put_many(broker: BrokerProc, n: int) -> None:
    x = masked(n)
    with broker.client() as c:
        for call in _puts(c, x):
            with pytest.raises(InvalidRequest) as err:
                call()
            msg = str(err.value)
            assert "masked" in msg and ".filled(" in msg and ".data" in msg, msg
        assert c.list() == []

        async def main() -> None:
            async with AsyncClient(broker.url) as ac:
                for coro in (lambda: ac.put("m", x), lambda: ac.put_many({"m": x})):
                    with pytest.raises(InvalidRequest, match=r"\.filled\("):
                        await coro()
                # What the message says to do works.
                await ac.put("filled", x.filled(0.0))
                await ac.put("data", x.data)
                got = await ac.get_many(["filled", "data"])
                assert np.array_equal(np.from_dlpack(got["filled"]), x.filled(0.0))
                assert np.array_equal(np.from_dlpack(got["data"]), x.data)
                del got
                for name in ("filled", "data"):
                    await ac.delete(name)

        asyncio.run(main())
    drained(broker, "leases", "versions", "bytes_in_use")
