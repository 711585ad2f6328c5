"""Names in bulk and batches that wait for any, against a real broker, through
both clients (``Client``, ``AsyncClient``), the command line and raw HTTP:
``list(prefix=)``, ``delete(prefix=)``, ``delete_many``, ``get_many(wait="any")``,
misses that name every missing name, and dtype names that mean one thing."""

from __future__ import annotations

import json
import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _both import Api
from _harness import BrokerProc, cli, free_port, ok, wait_for
from _rawhttp import Session
from tensordepot import Client, Forbidden, InvalidRequest, InvalidType, TensorMap, TensorNotFound


def _names(items: list[Any]) -> list[str]:
    return [i.name for i in items]


# -- by prefix ------------------------------------------------------------------------------------


def test_list_and_delete_by_prefix(api: Api, broker: BrokerProc) -> None:
    with broker.client() as producer:
        for name in ("run1/a", "run1/b", "run1x/c", "run2/a"):
            producer.put(name, np.full(4, len(name), np.float32))
        held = producer.get("run1/a")  # a reader keeps its bytes through the delete
        assert _names(api.list(prefix="run1/")) == ["run1/a", "run1/b"]
        assert _names(api.list(prefix="run")) == ["run1/a", "run1/b", "run1x/c", "run2/a"]
        assert _names(api.list(prefix="nothing/")) == []
        assert api.delete(prefix="run1/") == ["run1/a", "run1/b"]
        assert _names(api.list()) == ["run1x/c", "run2/a"]
        assert np.from_dlpack(held).tolist() == [6.0] * 4
        with pytest.raises(TensorNotFound, match="run1/a"):
            api.get("run1/a")
        assert api.delete(prefix="run1/") == []  # nothing left there: nothing to do
        assert api.delete("run2/a") == ["run2/a"]
        with pytest.raises(InvalidRequest, match="a name or prefix="):
            api.delete()
        with pytest.raises(InvalidRequest, match="a name or prefix="):
            api.delete("run1x/c", prefix="run")
        with pytest.raises(InvalidRequest, match="prefix 'a b' is not a valid"):
            api.list(prefix="a b")
        assert api.delete(prefix="run1x/") == ["run1x/c"]
        del held
        wait_for(lambda: producer.stat().leases == 0, 10, what="the held lease to go")
        assert producer.stat().tensors == 0


def test_delete_many_is_all_or_nothing_and_names_every_missing_name(api: Api) -> None:
    for name in ("a", "b", "c"):
        api.put(name, np.zeros(2, np.float32))
    with pytest.raises(TensorNotFound) as info:
        api.delete_many(["a", "gone1", "b", "gone2"])
    msg = str(info.value)
    assert "2 of the 4 names are not found: 'gone1', 'gone2'" in msg, msg
    assert "nothing was deleted" in msg, msg
    assert _names(api.list()) == ["a", "b", "c"]
    with pytest.raises(InvalidRequest, match="each name once"):
        api.delete_many(["a", "a"])
    with pytest.raises(InvalidType, match="use delete"):
        api.delete_many("a")
    before = api.round_trips
    assert api.delete_many([]) == []
    assert api.round_trips == before  # nothing to ask
    assert api.delete_many(["c", "a"]) == ["c", "a"]
    assert api.round_trips == before + 1
    assert _names(api.list()) == ["b"]
    api.delete("b")


def test_a_prefix_delete_of_10000_names_is_one_request(broker: BrokerProc) -> None:
    with broker.client() as c:
        names = [f"big/{i}" for i in range(10_000)]
        c.put_many(dict.fromkeys(names, np.zeros(1, np.float32)))
        c.put("big-but-not-under/x", np.zeros(1, np.float32))
        assert len(c.list(prefix="big/")) == 10_000
        before = c.round_trips
        deleted = c.delete(prefix="big/")
        assert c.round_trips == before + 1
        assert sorted(deleted) == sorted(names)
        assert _names(c.list()) == ["big-but-not-under/x"]
        c.delete("big-but-not-under/x")
        assert c.stat().tensors == 0


def test_a_prefix_limited_token_deletes_only_within_its_prefix(
    broker_factory: Any, tmp_path: Any
) -> None:
    tokens = tmp_path / "tokens"
    admin_token, team_token = secrets.token_hex(16), secrets.token_hex(16)
    tokens.write_text(f"{admin_token} admin\n{team_token} write prefix=team/\n")
    tokens.chmod(0o600)
    port = free_port()
    b = broker_factory("--listen", f"http://127.0.0.1:{port}", "--token-file", str(tokens))
    url = f"http://127.0.0.1:{port}"
    with Client(url, token=admin_token) as admin, Client(url, token=team_token) as team:
        for name in ("team/a", "team/b", "other/a"):
            admin.put(name, np.zeros(2, np.float32))
        assert _names(team.list()) == ["team/a", "team/b"]
        assert _names(team.list(prefix="t")) == ["team/a", "team/b"]
        with pytest.raises(Forbidden, match="outside that prefix"):
            team.delete(prefix="t")  # would reach beyond team/
        with pytest.raises(Forbidden, match="outside that prefix"):
            team.delete_many(["team/a", "other/a"])
        assert _names(admin.list()) == ["other/a", "team/a", "team/b"]
        assert team.delete(prefix="team/") == ["team/a", "team/b"]
        assert admin.delete(prefix="other/") == ["other/a"]
    assert b.alive


# -- the command line -----------------------------------------------------------------------------


def test_cli_lists_and_removes_by_prefix_and_many_at_once(broker: BrokerProc) -> None:
    with broker.client() as c:
        for name in ("run1/a", "run1/b", "run2/a", "x", "y"):
            c.put(name, np.zeros(2, np.float32))
    listed = json.loads(ok("ls", "--prefix", "run1/", "--json", "--url", broker.url))
    assert [i["name"] for i in listed] == ["run1/a", "run1/b"]
    assert json.loads(ok("rm", "--prefix", "run1/", "--json", "--url", broker.url)) == {
        "deleted": ["run1/a", "run1/b"],
        "missing": [],
        "refused": {},
    }
    none = cli("rm", "--prefix", "run1/", "--url", broker.url)
    assert none.returncode == 0, none.stderr
    assert none.stderr == "tensordepot rm: no tensor name starts with 'run1/'\n"
    assert ok("rm", "x", "y", "--url", broker.url) == ""  # both there: one request, silent
    usage = cli("rm", "--url", broker.url)
    assert usage.returncode == 2 and "or pass --prefix" in usage.stderr, usage.stderr
    with broker.client() as c:
        assert _names(c.list()) == ["run2/a"]
        c.delete("run2/a")


# -- get_many(wait="any") ------------------------------------------------------------------------


def test_wait_any_returns_once_one_name_is_newer_with_every_names_newest(
    api: Api, broker: BrokerProc
) -> None:
    with broker.client() as producer:
        producer.put_many({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})
        first = api.get_many(["a", "b"])
        floors = {k: t.version for k, t in first.items()}
        del first
        got: list[Any] = []

        def wait() -> None:
            try:
                got.append(api.get_many(["a", "b"], timeout=30, newer_than=floors, wait="any"))
            except BaseException as exc:
                got.append(exc)

        t0 = time.monotonic()
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for(lambda: producer.stat().waiting == 1, 10, what="the get_many to wait")
        producer.put("b", np.ones(2, np.float32))
        waiter.join(30)
        assert not waiter.is_alive() and time.monotonic() - t0 < 20
        out = got[0]
        assert isinstance(out, TensorMap), out
        assert out["a"].version == floors["a"] and out["b"].version > floors["b"]
        assert np.from_dlpack(out["b"]).tolist() == [1.0, 1.0]
        del out, got[:]
        # Newer already: it answers at once; with all, it would wait for a.
        now = api.get_many(["a", "b"], timeout=5, newer_than=floors, wait="any")
        assert now["b"].version > floors["b"]
        del now
        with pytest.raises(
            TensorNotFound,
            match=r"no version of 'a' newer than v1 was published "
            r"within 0\.3 s",
        ):
            api.get_many(["a", "b"], timeout=0.3, newer_than=floors, wait="all")
        with pytest.raises(TensorNotFound) as info:
            api.get_many(["a", "b"], timeout=0.3, newer_than={"a": 1, "b": 2}, wait="any")
        msg = str(info.value)
        assert "none of the 2 tensors got a newer version within 0.3 s" in msg, msg
        assert "'a' (v1, not newer than v1)" in msg and "'b' (v2, not newer than v2)" in msg, msg
        producer.delete_many(["a", "b"])


def test_a_batch_that_misses_names_every_missing_name(api: Api) -> None:
    api.put("here", np.zeros(2, np.float32))
    for timeout, said in ((0, "are not ready"), (0.2, "were not published within 0.2 s")):
        with pytest.raises(TensorNotFound) as info:
            api.get_many(["here", "gone1", "gone2"], timeout=timeout)
        msg = str(info.value)
        assert (
            f"2 of the 3 tensors {said}: 'gone1' (not published), 'gone2' (not published)" in msg
        ), msg
    with pytest.raises(TensorNotFound, match=r"'gone1' was not published within 0\.2 s"):
        api.get_many(["here", "gone1"], timeout=0.2)  # one missing: the message of a get
    api.delete("here")


def test_get_many_refuses_what_it_cannot_mean(api: Api) -> None:
    api.put("a", np.zeros(2, np.float32))
    with pytest.raises(InvalidRequest, match=r"newer_than names 1 tensor.* 'b'"):
        api.get_many(["a"], newer_than={"a": 0, "b": 3})
    with pytest.raises(InvalidRequest, match=r"wait must be 'all'.*or 'any'"):
        api.get_many(["a"], wait="some")
    api.delete("a")


def test_wait_any_and_many_delete_over_raw_http(broker: BrokerProc) -> None:
    """The wire: ``wait`` in /v1/many/get's body, /v1/many/delete; bad values are refused."""
    with broker.client() as c:
        c.put("a", np.zeros(2, np.float32))
    raw = Session(broker.sock)
    try:
        body = {"names": ["a"], "newer_than": [0], "wait": "any"}
        status, answer = raw.send("POST", "/v1/many/get", body)
        assert status == 200 and answer["names"] == ["a"], answer
        status, answer = raw.send("POST", "/v1/many/get", {**body, "wait": "most"})
        assert status in (400, 422) and answer["error"]["code"] == "invalid_request", answer
        status, answer = raw.send("POST", "/v1/many/delete", {"names": ["a"], "prefix": "a"})
        assert status in (400, 422) and "one of the two" in answer["error"]["message"], answer
        status, answer = raw.send("POST", "/v1/many/delete", {})
        assert status in (400, 422) and "one of the two" in answer["error"]["message"], answer
        status, answer = raw.send("POST", "/v1/many/delete", {"prefix": "a b"})
        assert status in (400, 422) and "not a valid tensor name" in answer["error"]["message"]
        status, answer = raw.send("GET", "/v1/tensors?prefix=b")
        assert status == 200 and answer == {"items": []}, answer
        status, answer = raw.send("POST", "/v1/many/delete", {"prefix": "a"})
        assert status == 200 and answer == {"names": ["a"]}, answer
        # The broker holds the client's dtype rule for what comes over the wire.
        status, answer = raw.send(
            "POST", "/v1/many/alloc", {"names": ["y"], "shapes": [[2]], "dtypes": ["float"]}
        )
        assert status == 400 and "ambiguous" in answer["error"]["message"], answer
    finally:
        raw.close()
    with broker.client() as c:
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().tensors == 0,
            10,
            what="the raw session's lease to go with it",
        )


# -- dtype names ----------------------------------------------------------------------------------


def test_dtype_names_that_mean_two_things_are_refused(api: Api) -> None:
    for bare, torch_means, numpy_means in (
        ("float", "float32", "float64"),
        ("int", "int32", "int64"),
    ):
        with pytest.raises(InvalidRequest) as info:
            api.empty("x", (2,), bare)
        msg = str(info.value)
        assert f"torch reads it as {torch_means}, numpy as {numpy_means}" in msg, msg
    for spelled, want in (
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        (torch.float32, "float32"),
        (torch.float, "float32"),
        (torch.int, "int32"),
        (np.float64, "float64"),
        (np.dtype("int16"), "int16"),
        ("torch.float", "float32"),
        ("double", "float64"),
    ):
        t = api.empty("x", (2,), spelled)
        assert t.dtype == want, (spelled, t.dtype)
        api.publish(t) if api.kind == "async" else t.publish()
        del t
    api.delete("x")


def test_python_numbers_and_lists_need_a_dtype(api: Api) -> None:
    for value in ([1, 2, 3], 2.5, 7, (1.0, 2.0), True):
        with pytest.raises(InvalidType, match=r"would be a guess.*dtype="):
            api.put("x", value)
    with pytest.raises(InvalidType, match="would be a guess"):
        api.put_many({"w": np.zeros(2, np.float32), "lst": [1, 2]})
    assert _names(api.list()) == []  # nothing of the refused batch was kept
    assert api.put("x", [1, 2, 3], dtype="float32") >= 1
    assert api.put("s", 2.5, dtype=torch.float64) >= 1
    got = api.get_many(["x", "s"])
    assert got["x"].dtype == "float32" and np.from_dlpack(got["x"]).tolist() == [1.0, 2.0, 3.0]
    assert got["s"].dtype == "float64" and got["s"].shape == ()
    del got
    assert api.put("n", np.float64(1.5)) >= 1  # a numpy scalar has its dtype
    assert api.put("m", np.arange(3, dtype=np.float32), dtype="float32") >= 1
    with pytest.raises(InvalidRequest, match="has dtype int64, not float32"):
        api.put("m", np.arange(3), dtype="float32")
    with pytest.raises(InvalidRequest, match="cannot be made a uint8 array"):
        api.put("m", [1, 300], dtype="uint8")
    with pytest.raises(InvalidRequest, match="ambiguous"):
        api.put("m", [1], dtype="int")
    assert api.delete_many(["x", "s", "n", "m"]) == ["x", "s", "n", "m"]
