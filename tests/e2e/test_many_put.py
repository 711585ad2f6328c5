"""A batch of small tensors whose bytes ride in its request (``/v1/many/put``),
through a real broker: one round trip, bit-exact, all or none.

``put_many`` sends a batch's bytes in the request when they are at most
``INLINE_BATCH_MAX`` in all and average at most ``INLINE_BATCH_MEAN`` a
tensor; other batches are allocated, copied into the mapping and published.
Bad framed bodies are refused with 400 and place nothing."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from _harness import BrokerProc, stat_when, wait_for
from _rawhttp import Session, encode, exchange
from _rawlane import answered
from tensordepot._proto import INLINE_BATCH_MAX, INLINE_BATCH_MEAN, SESSION_HEADER

KiB = 1024


def _counts(b: BrokerProc) -> tuple[int, int, int]:
    return (
        answered(b, "POST", "/v1/many/put"),
        answered(b, "POST", "/v1/many/alloc"),
        answered(b, "POST", "/v1/many/publish"),
    )


def test_a_batch_of_small_tensors_is_put_in_one_request_bit_exact(broker: BrokerProc) -> None:
    rng = np.random.default_rng(7)
    w = torch.randn(4, 8)
    sd = {f"layer.{i}.w": rng.standard_normal(64).astype(np.float32) for i in range(300)}
    sd.update(
        {
            "bf16": torch.randn(3, 5).to(torch.bfloat16),
            "f8": np.arange(16, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn),
            "bool": np.array([True, False, True]),
            "scalar": np.float64(2.5).reshape(()),
            "empty": np.zeros((0, 4), np.int16),
            "strided": np.arange(40, dtype=np.int64).reshape(5, 8)[:, ::3],  # not C-contiguous
            "tied.a": w,
            "tied.b": w,  # the very same bytes: sent and stored once
        }
    )
    with broker.client() as producer, broker.client() as consumer:
        before = _counts(broker)
        versions = producer.put_many(sd)
        assert _counts(broker) == (before[0] + 1, before[1], before[2]), "one request"
        assert sorted(versions) == sorted(sd) and set(versions.values()) == {1}
        got = consumer.get_many(list(sd))
        for name, x in sd.items():
            t = got[name]
            if isinstance(x, torch.Tensor):
                assert torch.equal(torch.from_dlpack(t), x), name
            else:
                want = np.asarray(x)
                assert t.shape == want.shape, name
                assert t.numpy().tobytes() == np.ascontiguousarray(want).tobytes(), name
        assert got["tied.a"]._address == got["tied.b"]._address, "one copy of a tie"
        assert got["bf16"].dtype == "bfloat16" and got["f8"].dtype == "float8_e4m3fn"
        own = sum(x.nbytes for k, x in sd.items() if k != "tied.b")
        assert own <= producer.stat().bytes_in_use < own + 256 * len(sd), "tied bytes once"
        del got, t
        again = producer.put_many(sd)  # the next version of each, the same way
        assert set(again.values()) == {2}
        assert _counts(broker)[0] == before[0] + 2
        producer.delete_many(list(sd))
        wait_for(
            lambda: producer.stat().bytes_in_use == 0 and producer.stat().leases == 0,
            10,
            what="every version freed",
        )


@pytest.mark.parametrize(
    ("n", "size"), [(4, 64 * KiB), (2, INLINE_BATCH_MAX)], ids=["large-average", "over-the-cap"]
)
def test_batches_of_larger_tensors_are_copied_into_the_mapping(
    broker: BrokerProc, n: int, size: int
) -> None:
    assert size > INLINE_BATCH_MEAN
    sd = {f"t{i}": np.full(size, i, np.uint8) for i in range(n)}
    with broker.client() as c:
        before = _counts(broker)
        c.put_many(sd)
        assert _counts(broker) == (before[0], before[1] + 1, before[2] + 1)
        got = c.get_many(list(sd))
        assert all((got[k].numpy() == i).all() for i, k in enumerate(sd))
        del got
        c.delete_many(list(sd))


def _send(b: BrokerProc, sid: str, head: object, data: bytes) -> tuple[int, dict[str, object]]:
    text = json.dumps(head).encode()
    body = len(text).to_bytes(4, "big") + text + data
    a = exchange(
        b.sock,
        encode(
            "POST",
            "/v1/many/put",
            [(SESSION_HEADER, sid), ("content-type", "application/octet-stream")],
            body,
        ),
    )
    return a.status, json.loads(a.body or b"null")


def test_a_bad_framed_batch_is_refused_and_places_nothing(broker_factory: object) -> None:
    b = broker_factory("--max-memory-per-session", "64KiB")  # type: ignore[operator]
    raw = Session(b.sock)
    with b.client() as c:
        c.put("keep", np.arange(4, dtype=np.float32))
        sid = raw.sid
        head = {"names": ["x", "y"], "shapes": [[16], [16]], "dtypes": ["uint8", "uint8"]}
        cases = {
            "short": (head, b"\1" * 31, 400, "need 32"),
            "long": (head, b"\1" * 33, 400, "need 32"),
            "bad dtype": ({**head, "dtypes": ["uint8", "nope"]}, b"\1" * 32, 400, "nope"),
            "bad same": ({**head, "same": [1, -1]}, b"\1" * 16, 400, "same[0]"),
            "same bytes twice": ({**head, "same": [-1, 0]}, b"\1" * 32, 400, "need 16"),
            "over the cap": (
                {"names": ["x"], "shapes": [[INLINE_BATCH_MAX + 1]], "dtypes": ["uint8"]},
                b"\0" * (INLINE_BATCH_MAX + 1),
                400,
                "at most",
            ),
            "over the quota": (
                {"names": ["x"], "shapes": [[80 * KiB]], "dtypes": ["uint8"]},
                b"\0" * (80 * KiB),
                507,
                "max-memory-per-session",
            ),
        }
        st = c.stat()
        # Twice: the second time the broker has each head parsed and planned
        # already (_handler.parse_framed, _packs.Plans), and must refuse the
        # same way; then the good head, between two bad bodies after it.
        for what, (h, data, status, says) in [*cases.items(), *cases.items()]:
            got, answer = _send(b, sid, h, data)
            assert got == status, (what, answer)
            message = answer["error"]["message"]  # type: ignore[index]
            assert says in message, (what, message)
            now = c.stat()
            assert (now.tensors, now.versions, now.bytes_in_use) == (
                st.tensors,
                st.versions,
                st.bytes_in_use,
            ), (what, now)
        assert sorted(t.name for t in c.list()) == ["keep"]
        assert _send(b, sid, head, b"\1" * 32) == (200, {"names": ["x", "y"], "versions": [1, 1]})
        assert _send(b, sid, head, b"\1" * 31)[0] == 400
        assert _send(b, sid, head, b"\2" * 32) == (200, {"names": ["x", "y"], "versions": [2, 2]})
        assert c.get("x").numpy().tolist() == [2] * 16
        c.delete_many(["x", "y"])
        assert c.get("keep").numpy().tolist() == [0, 1, 2, 3], "the broker keeps serving"
        c.delete("keep")
    raw.close()


def test_an_alloc_many_body_sent_again_is_checked_again(broker: BrokerProc) -> None:
    """The broker keeps what the last alloc_many bodies parsed as
    (``_handler.parse_kept``): the same bytes sent again allocate as the first
    did, and sent as anything but JSON, or in a session that is not open, are
    refused as they would be the first time, allocating nothing."""
    raw = Session(broker.sock)
    body = {"names": ["k.x", "k.y"], "shapes": [[16], [4, 2]], "dtypes": ["uint8", "float32"]}
    data = json.dumps(body).encode()

    def alloc(ctype: str, sid: str = "") -> tuple[int, dict[str, object]]:
        headers = [(SESSION_HEADER, sid or raw.sid), ("content-type", ctype)]
        a = exchange(broker.sock, encode("POST", "/v1/many/alloc", headers, data))
        return a.status, json.loads(a.body or b"null")

    with broker.client() as c:
        for k in (1, 2):  # the second: parsed and planned already
            status, got = alloc("application/json")
            assert status == 200 and got["names"] == body["names"], got
            assert got["versions"] == [k, k] and c.stat().versions == 2 * k, got
            for bad in (
                "text/plain",
                "application/octet-stream",
                "application/x-www-form-urlencoded",
            ):
                status, got = alloc(bad)
                assert status == 400 and "application/json" in str(got), (bad, got)
                assert c.stat().versions == 2 * k, f"{bad} allocated"
        status, got = alloc("application/json", sid="not-a-session")
        assert (status, got["error"]["code"]) == (409, "unknown_session"), got  # type: ignore[index]
        assert c.stat().versions == 4
    raw.close()  # ends the session: its unpublished versions go with it
    with broker.client() as c:
        stat_when(c, lambda st: st.versions == 0 and st.bytes_in_use == 0, "the writes gone")


def test_batches_copied_around_freed_holes_are_bit_exact_and_need_no_numpy_in_the_broker(
    broker: BrokerProc,
) -> None:
    """The broker copies a batch's bytes run by run (back-to-back blocks in
    one copy) without numpy, whose import would cost its first put_many about
    0.1 s; the library would show in the broker's mappings."""

    def numpy_loaded() -> bool:
        assert broker.proc is not None
        with open(f"/proc/{broker.proc.pid}/maps") as f:
            return "_multiarray_umath" in f.read()

    rng = np.random.default_rng(3)
    with broker.client() as c:
        for i in range(20):
            c.put(f"hole.{i}", np.full(KiB, i, np.uint8))
        c.delete_many([f"hole.{i}" for i in range(0, 20, 2)])  # holes between live blocks
        sd = {f"n.{i}": rng.integers(0, 255, 64 * (1 + i % 7), dtype=np.uint8) for i in range(40)}
        before = _counts(broker)
        c.put_many(sd)
        assert _counts(broker)[0] == before[0] + 1, "one request with the bytes"
        got = c.get_many(list(sd))
        for name, x in sd.items():
            assert np.array_equal(np.from_dlpack(got[name]), x), name
        del got
        for i in range(1, 20, 2):
            assert c.get(f"hole.{i}").numpy().tolist() == [i] * KiB, "a neighbour kept its bytes"
        assert not numpy_loaded(), "the broker imported numpy"
        c.delete_many([*sd, *(f"hole.{i}" for i in range(1, 20, 2))])
