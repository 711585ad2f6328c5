"""Bad input gets an error from the documented tree, against a real broker:
a ``DepotError`` subclass (``InvalidRequest`` is also a ``ValueError``,
``InvalidType`` also a ``TypeError``) whose message names the argument, what
was given (cut to a sane length) and what is allowed.  Nothing is left
behind, and the client goes on working."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, drained
from tensordepot import (
    BrokerUnavailable,
    Client,
    DepotError,
    InvalidRequest,
    InvalidType,
    TensorNotFound,
    WaitTimedOut,
)

NAME_RULE = "1 to 512 printable ASCII characters, no spaces"  # as the README states it
ARR = np.arange(4, dtype=np.float32)


def raises(exc_type: type[DepotError], call: Any, *parts: str) -> str:
    """Run ``call``; it must raise exactly ``exc_type`` with every part in its message."""
    with pytest.raises(DepotError) as info:
        call()
    assert type(info.value) is exc_type, (type(info.value), info.value)
    message = str(info.value)
    missing = [p for p in parts if p not in message]
    assert not missing, f"{missing} not in {message!r}"
    return message


@pytest.fixture
def client(broker: BrokerProc) -> Iterator[Client]:
    with broker.client() as c:
        yield c
        # refused input left nothing: no other name, no lease
        assert {i.name for i in c.list()} <= {"w"} and c.stat().leases == 0


def test_the_tree_keeps_the_builtin_bases() -> None:
    assert issubclass(InvalidRequest, ValueError) and issubclass(InvalidRequest, DepotError)
    assert issubclass(InvalidType, TypeError) and issubclass(InvalidType, InvalidRequest)


@pytest.mark.parametrize(
    "value,given",
    [
        pytest.param({"a": 1}, "dict {'a': 1}", id="dict"),
        pytest.param(None, "NoneType None", id="None"),
        pytest.param("hello", "str 'hello'", id="str"),
    ],
)
def test_put_of_what_is_not_a_tensor(client: Client, value: Any, given: str) -> None:
    raises(
        InvalidType,
        lambda: client.put("d", value),
        "x must be",
        given,
        "a numpy array",
        "__dlpack__",
        "a number or list of numbers",
    )


def test_put_with_no_name(client: Client) -> None:
    raises(
        InvalidType,
        lambda: client.put(None, ARR),  # type: ignore[arg-type]
        "name must be a str",
        NAME_RULE,
        "not NoneType None",
    )


def test_put_many_of_a_list(client: Client) -> None:
    message = raises(
        InvalidType,
        lambda: client.put_many([ARR]),  # type: ignore[arg-type]
        "tensors must be a mapping of name -> tensor",
        "not list [array(",
    )
    assert len(message) < 200, message


def test_put_many_of_arrays_with_one_of_a_dtype_never_stored(client: Client) -> None:
    """A batch of numpy arrays, one of them of objects: the error names that
    one, and nothing of the batch is stored."""
    good = {f"dt.{d}": np.arange(6).astype(d).reshape(2, 3) for d in ("bool", "int8", "float16")}
    batch = {**good, "dt.bad": np.array([None, 1], dtype=object), "dt.last": ARR}
    raises(InvalidRequest, lambda: client.put_many(batch), "tensors['dt.bad'] has dtype object")
    assert [t.name for t in client.list("dt.")] == []
    versions = client.put_many(good)  # the same arrays, all of stored dtypes
    got = client.get_many(list(good))
    for k, a in good.items():
        t = np.from_dlpack(got[k])
        assert (versions[k], t.dtype, t.shape, t.tolist()) == (1, a.dtype, (2, 3), a.tolist())
    del got, t
    client.delete_many(list(good))
    drained(client, "leases")  # the batch's lease goes back in the background


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: beta, prototype, deprecated
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested", "quantized", "meta"])
def test_a_torch_tensor_of_no_strided_bytes_is_refused_saying_what_to_put(
    client: Client, kind: str
) -> None:
    """torch would refuse to export these with an error of its own (a
    BufferError, a RuntimeError that asks to file an issue): put and
    put_many refuse them as the wrong type, name the tensor, store nothing,
    and what the message says to put instead is stored."""
    torch = pytest.importorskip("torch")
    dense = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    parts = [torch.ones(2), torch.full((3,), 2.0)]
    x, hint = {
        "sparse_coo": (dense.to_sparse(), ".to_dense()"),
        "sparse_csr": (dense.to_sparse_csr(), ".to_dense()"),
        "nested": (torch.nested.nested_tensor(parts), ".unbind()"),
        "quantized": (torch.quantize_per_tensor(dense, 0.5, 0, torch.qint8), ".dequantize()"),
        "meta": (torch.empty(2, 3, device="meta"), ".shape, "),
    }[kind]
    raises(InvalidType, lambda: client.put("w", x), "x is ", "tensordepot does not store", hint)
    raises(InvalidType, lambda: client.put_many({"ok": ARR, "w": x}), "tensors['w'] is ", hint)
    assert client.list() == []
    if kind == "nested":
        client.put_many({f"w.{i}": t for i, t in enumerate(x.unbind())})
        got = client.get_many(["w.0", "w.1"])
        assert [torch.from_dlpack(got[k]).tolist() for k in got] == [[1.0] * 2, [2.0] * 3]
        del got
        client.delete_many(["w.0", "w.1"])
    elif kind == "meta":
        t = client.empty("w", x.shape, x.dtype)
        torch.from_dlpack(t).copy_(dense)
        t.publish()
        del t
    else:
        client.put("w", x.dequantize() if kind == "quantized" else x.to_dense())
    if kind != "nested":
        assert torch.from_dlpack(client.get("w")).tolist() == dense.tolist()
    drained(client, "leases")


def test_get_many_of_a_str(client: Client) -> None:
    message = raises(
        InvalidType,
        lambda: client.get_many("nc"),
        "names must be a list of tensor names",
        "not str 'nc'",
        "use get()",
    )
    assert "'n' not found" not in message


def test_get_with_a_str_timeout(client: Client) -> None:
    raises(
        InvalidType,
        lambda: client.get("w", timeout="5"),  # type: ignore[arg-type]
        "timeout must be a number of seconds or None",
        "not str '5'",
    )


def test_a_newer_than_timeout_names_the_newest_version(client: Client) -> None:
    for _ in range(3):
        client.put("w", ARR)
    message = raises(
        WaitTimedOut,
        lambda: client.get("w", timeout=0.3, newer_than=3),
        "no version of 'w' newer than v3",
        "within 0.3 s",
        "the newest is v3",
    )
    assert "was not published" not in message


def test_a_wait_that_runs_out_is_a_timeout_error_and_a_key_error(client: Client) -> None:
    """Python code waits for TimeoutError; code that looks a name up, for KeyError."""
    for call in (
        lambda: client.get("never", timeout=0.05),
        lambda: client.get_many(["never", "nor"], timeout=0.05),
        lambda: client.get_many(["never"], timeout=0.05, wait="any"),
    ):
        with pytest.raises(TimeoutError) as info:
            call()
        assert isinstance(info.value, TensorNotFound) and isinstance(info.value, KeyError)
    with pytest.raises(TensorNotFound) as missing:
        client.get("never")  # no wait: not found, not timed out
    assert not isinstance(missing.value, TimeoutError)
    assert client.get("w", newer_than=None) is not None if client.put("w", ARR) else False
    client.delete("w")


def test_a_dtype_of_none_is_refused_not_read_as_float64(client: Client) -> None:
    raises(InvalidType, lambda: client.empty("x", (2,), None), "dtype is None")
    assert client.list() == []


def test_delete_of_a_missing_name(client: Client) -> None:
    message = raises(
        TensorNotFound, lambda: client.delete("missing"), "'missing' not found", "nothing to delete"
    )
    assert "timeout" not in message


def test_a_name_with_a_space_states_the_rule(client: Client) -> None:
    message = raises(
        InvalidRequest,
        lambda: client.put("has space", ARR),
        "name 'has space' is not a valid tensor name",
        NAME_RULE,
    )
    assert "validation error" not in message and "AllocRequest" not in message


def test_a_huge_name_is_cut_short(client: Client) -> None:
    name = "x" * 10_000
    for call in (
        lambda: client.put(name, ARR),
        lambda: client.get(name),
        lambda: client.delete(name),
    ):
        message = raises(
            InvalidRequest, call, "is not a valid tensor name", NAME_RULE, "(10002 characters)"
        )
        assert len(message) < 300, len(message)


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Some other HTTP server: 404 with a short text body for everything."""

    def do_POST(self) -> None:
        body = b"no such page\n"
        self.send_response(404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_DELETE = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _NotImplemented(_NotFound):
    """Another: the standard library's 501 HTML error page for everything."""

    def do_POST(self) -> None:
        self.send_error(501, "Unsupported method")

    do_GET = do_DELETE = do_POST


@pytest.fixture(
    params=[
        pytest.param((_NotFound, 404), id="404"),
        pytest.param((_NotImplemented, 501), id="501-html"),
    ]
)
def other_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    handler, status = request.param
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", status
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_url_of_another_server_is_not_a_broker(other_server: tuple[str, int]) -> None:
    url, status = other_server
    for make in (lambda: Client(url), lambda: Client(url, token="t" * 32)):
        with pytest.raises(BrokerUnavailable) as info:
            make()
        message = str(info.value)
        assert f"URL {url} is not a tensordepot broker" in message, message
        assert f"answered {status}" in message, message
        assert "<html" not in message.lower() and "<!doctype" not in message.lower(), message
