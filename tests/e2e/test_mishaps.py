"""The mishaps users cause, with real processes: no live view ever sees
another tensor's bytes (README, Lifetime: M1 to M8).

Each test makes one mishap happen to a real worker (a writer that keeps its
views, SIGSTOP past the session TTL in another pid namespace, Ctrl-C in the
middle of a copy or a wait, fork), then makes the broker hand the memory in
question to *another* tensor if it would, and checks that tensor's bytes,
and the worker's own views, bit for bit.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, drained, in_pid_namespace, run_worker, stat_when, wait_for
from _interrupt import interrupt_at
from _rawhttp import Session, encode, exchange
from _workerio import Worker
from pydantic import BaseModel
from tensordepot import Client, TensorNotFound
from tensordepot._proto import REQUEST_HEADER, SESSION_HEADER
from tensordepot._wire import Handle, HandleColumns

MiB = 1 << 20
N = MiB // 4  # float32 elements of a 1 MiB tensor (a pooled block)


@pytest.fixture
def mishap(workers: Callable[..., Worker]) -> Callable[..., Worker]:
    """A ``mishap`` worker of a broker, once it says it is ready."""
    return lambda *args: workers("mishap", *args, ready="ready")


def churn(c: Client, name: str, n: int, fill: float) -> np.ndarray:
    """Put ``name`` once, right after the memory in question would have been
    freed: first fit places it in that very range if it is free, and returns a
    view of it (a reader holding it)."""
    c.put(name, np.full(n, fill, dtype=np.float32))
    return np.from_dlpack(c.get(name))


def same(view: np.ndarray, fill: float) -> bool:
    return bool(view.tobytes() == np.full(view.shape, fill, dtype=np.float32).tobytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- M1/M2: a writer's views outlive its version ------------------------------------------------


@pytest.mark.parametrize("how", ["supersede", "delete", "ttl"])
def test_writer_views_never_reach_another_tensor(
    broker: BrokerProc, mishap: Callable[..., Worker], how: str
) -> None:
    w = mishap(broker.url)
    w.ask(f"empty a {N} 1.0" + (" 0.5" if how == "ttl" else ""), "ok")
    with broker.client() as c:
        if how == "supersede":
            c.put("a", np.full(N, 2.0, dtype=np.float32))
        elif how == "delete":
            c.delete("a")
        else:
            wait_for(lambda: not any(i.name == "a" for i in c.list()), 10, what="'a' to expire")
        held = churn(c, "b", N, 7.0)
        w.ask("scribble a -999", "ok")  # through the writer's numpy and torch views
        assert same(held, 7.0), "a writer's stale view changed another tensor's bytes"
        assert same(np.from_dlpack(c.get("b")), 7.0)
        if how == "supersede":
            assert same(np.from_dlpack(c.get("a")), 2.0)
        w.ask("drop a", "ok")
        del held


def test_a_write_after_publish_never_reaches_readers(
    broker: BrokerProc, mishap: Callable[..., Worker]
) -> None:
    w = mishap(broker.url)
    w.ask(f"empty a {N} 1.0", "ok")
    with broker.client() as c:
        held = np.from_dlpack(c.get("a"))
        w.ask("scribble a 5.0", "ok")
        assert same(held, 1.0) and same(np.from_dlpack(c.get("a")), 1.0), "published bytes changed"
        del held


# -- M1: a paused client the broker cannot vouch for --------------------------------------------


@pytest.mark.parametrize("holds", ["reader", "writer"])
def test_paused_client_past_its_ttl_keeps_its_bytes(
    broker_factory: Callable[..., BrokerProc], holds: str
) -> None:
    """A client in another pid namespace, over TCP: the broker cannot check its
    pid, so it lives on heartbeats.  SIGSTOP it past --session-ttl: it is
    reaped, and the memory it may still map is retired, never reused."""
    prefix = in_pid_namespace()
    if prefix is None:
        pytest.skip("needs root and unshare --pid to put the client in another pid namespace")
    tcp = f"http://127.0.0.1:{free_port()}"
    token = {"TENSORDEPOT_TOKEN": secrets.token_urlsafe(24)}
    broker_factory("--listen", tcp, "--session-ttl", "1", env=token)
    w = Worker("mishap", tcp, launcher=prefix, env=token)  # its pid in its namespace is 1 or 2
    proc = w.proc
    try:
        w.expect("ready")
        with Client(tcp, token=token["TENSORDEPOT_TOKEN"]) as c:
            if holds == "reader":
                c.put("a", np.full(N, 1.0, dtype=np.float32))
                w.ask("get a", "ok")
            else:
                w.ask(f"hold a {N} 1.0", "ok")
            os.kill(proc.pid, signal.SIGSTOP)  # unshare: the whole namespace's tree stops with it
            for p in _children(proc.pid):
                os.kill(p, signal.SIGSTOP)
            stat_when(c, lambda s: s.sessions == 1, "the paused session to be reaped", 15)
            if holds == "reader":
                c.delete("a")  # the paused reader's version is gone now; its bytes stay retired
            # Retired: never handed out again (its segment is unlinked once nothing
            # else lives in it; the paused process keeps its own mapping).
            stat_when(
                c, lambda s: s.retired_total >= MiB, "the paused client's memory to be retired"
            )
            held = churn(c, "b", N, 7.0)
            for p in [proc.pid, *_children(proc.pid)]:
                os.kill(p, signal.SIGCONT)
            if holds == "reader":
                assert w.ask("check a", "") == "same", "a resumed reader sees other bytes"
            else:
                w.ask("scribble a -999", "ok")
            assert same(held, 7.0) and same(np.from_dlpack(c.get("b")), 7.0)
            # Once the resumed process lets go of its views, it says so, and the
            # retired memory is reused, though other tensors still live in its segment.
            w.ask("drop a", "ok")
            stat_when(
                c, lambda s: s.bytes_retired == 0, "the resumed client to give its memory back"
            )
            assert c.stat().tensors >= 1
            w.send("exit")
            assert w.wait() == 0, w.stderr()
            del held
            c.delete("b")
            stat_when(
                c,
                lambda s: s.bytes_retired == 0 and s.bytes_in_use == 0,
                "the retired segment to go once nothing else lives in it",
            )
    finally:
        w.close()


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


# -- M1: Ctrl-C in the middle of a copy -----------------------------------------------------------


def test_ctrl_c_during_a_big_put_stops_its_copy(
    broker_factory: Callable[..., BrokerProc], mishap: Callable[..., Worker]
) -> None:
    b = broker_factory(max_memory="4GiB")
    w = mishap(b.url)
    w.ask("bigput warm 512", "putting")
    w.expect("done", timeout=120)  # the segment now exists and stays warm
    with b.client() as c:
        c.delete("warm")
        side = int((512 << 18) ** 0.5)
        # Made before the interrupt, so nothing delays the put after it.
        y = np.full(side * side, 7.0, dtype=np.float32)
        # The interrupt is sent once the allocation is seen; a put whose copy
        # ended before it (a test process starved of CPU for that long) is
        # deleted and tried again.
        for _ in range(5):
            w.send("bigput x 512")  # a non-contiguous source: split by rows over the copy threads
            w.expect("putting")
            stat_when(c, lambda s: s.bytes_in_use >= 500 * MiB, "the allocation to be made", 30)
            os.kill(w.pid, signal.SIGINT)
            said = w.line(timeout=60)
            if said.startswith("interrupted"):
                break
            assert said.startswith("done"), said
            c.delete("x")
            stat_when(c, lambda s: s.bytes_in_use < 500 * MiB, "the finished put to be freed", 30)
        else:
            raise AssertionError("5 puts in a row finished before their Ctrl-C was taken")
        # The aborted allocation is given back (at once after its copy stopped; an
        # interrupt that lands while the allocation's answer is read cancels it instead,
        # from the background thread); a put of the same size lands in its (warm,
        # dedicated) segment, while the aborted copy would still run.
        wait_for(
            lambda: not any(i.name == "x" for i in c.list()),
            10,
            what="the interrupted put's allocation to be given back",
        )
        c.put("y", y)
        got = np.from_dlpack(c.get("y"))
        assert same(got, 7.0), "an aborted put's copy kept writing into the next tensor"
        w.ask("put z 1 0", "ok")  # the worker carries on after the interrupt
        assert same(got, 7.0), "an aborted put's copy kept writing into the next tensor"
        del got, y


@pytest.mark.parametrize("op", ["put", "empty", "get", "get_many"])
def test_ctrl_c_while_an_answer_is_read_gives_back_what_it_granted(
    broker: BrokerProc, op: str
) -> None:
    """The interrupt lands after the broker's answer arrived, while the client
    parses it: nobody holds the allocation or lease yet, so the client cancels
    it (tests/_interrupt.py makes it land there every time)."""
    big = np.full(N, 2.0, dtype=np.float32)  # above INLINE_MAX: an allocation
    with broker.client() as c:
        c.put("held", big)
        before = c.stat()
        model = {"put": Handle, "empty": Handle, "get": Handle, "get_many": HandleColumns}[op]
        parse = interrupt_at(
            BaseModel.model_validate_json.__code__,
            where=lambda frame: frame.f_locals.get("cls") is model,
        )
        with pytest.raises(KeyboardInterrupt), parse:
            if op == "put":
                c.put("x", big)
            elif op == "empty":
                c.empty("x", (N,), "float32")
            elif op == "get":
                c.get("held")
            else:
                c.get_many(["held"])
        stat_when(
            c,
            lambda s: (
                (s.leases, s.versions, s.bytes_in_use)
                == (before.leases, before.versions, before.bytes_in_use)
            ),
            f"the interrupted {op}'s grant to be given back",
        )
        assert [i.name for i in c.list()] == ["held"]
        c.put("x", big)  # the client carries on
        assert same(np.from_dlpack(c.get("x")), 2.0)


# -- M8: fork --------------------------------------------------------------------------------------


def test_fork_child_client_works_and_inherited_views_hold(
    broker: BrokerProc, mishap: Callable[..., Worker], tmp_path_factory: pytest.TempPathFactory
) -> None:
    fifo = str(tmp_path_factory.mktemp("fork") / "cmds")
    os.mkfifo(fifo)
    w = mishap(broker.url)
    w.ask("bigput warm 64", "putting")  # the copy threads exist in the parent
    w.expect("done")
    with broker.client() as c:
        c.put("a", np.full(N, 1.0, dtype=np.float32))
        w.ask("get a", "ok")
        w.ask(f"empty e {N} 4.0", "ok")
        w.send(f"fork {fifo}")
        w.expect("forked")
        w.expect("child put", timeout=60)  # the inherited Client works; a hang fails here
        with open(fifo, "w") as cmds:
            # The parent lets go of everything; the memory would be reused.
            w.ask("drop a", "ok")
            w.ask("drop e", "ok")
            c.delete("a")
            c.delete("e")
            held = churn(c, "b", N, 7.0)
            cmds.write("check a\n")
            cmds.flush()
            assert w.expect("child") == "child same", "a forked child's inherited view changed"
            cmds.write("scribble e -999\n")
            cmds.flush()
            w.expect("child ok")
            assert same(held, 7.0) and same(np.from_dlpack(c.get("b")), 7.0)
            assert same(np.from_dlpack(c.get("child.put")), 3.0)
            cmds.write("exit\n")
        del held


@pytest.mark.parametrize("where", ["before", "after"])
def test_ctrl_c_during_fork_leaves_every_client_working(broker: BrokerProc, where: str) -> None:
    """A KeyboardInterrupt due as the Clients' fork hooks run (as they plan
    the fork, or as the parent comes out of it) leaves no lock held, no
    Client half set up, and the views the child inherited their own bytes."""
    res = run_worker("fork_interrupted", broker.url, where, timeout=120)
    out = res.stdout.split()
    assert out[-1:] == ["ok"] and "child" in out, res.stdout + res.stderr
    # In a hook (reported, dropped) or in the caller: after the fork there is
    # no Python hook of the Clients' left to run in the parent.
    landed = "KeyboardInterrupt" in res.stderr or "interrupted" in out
    assert landed and "logging" not in res.stderr, f"the Ctrl-C landed elsewhere:\n{res.stderr}"
    with broker.client() as c:
        stat_when(
            c,
            lambda s: (s.sessions, s.leases, s.versions) == (1, 0, 0),
            "the worker's and its child's sessions to end",
        )


# -- M3: versions only grow ------------------------------------------------------------------------


def test_versions_never_go_backwards(broker: BrokerProc, mishap: Callable[..., Worker]) -> None:
    with broker.client() as c:
        for i in range(3):
            c.put("v", np.full(4, float(i), dtype=np.float32))
        assert c.get("v").version == 3
        c.delete("v")
        w = mishap(broker.url)
        w.ask("hold v 4 1.0", "ok")  # an empty() of the same name, never published...
        w.kill()
        w.wait()  # ...and reclaimed when its writer dies
        stat_when(c, lambda s: s.versions == 0, "the dead writer's version to be reclaimed")
        waiter = mishap(broker.url)
        waiter.send("waitget v")
        waiter.expect("waiting")
        v = c.put("v", np.full(4, 9.0, dtype=np.float32))
        assert v > 4, f"after v3 and a reclaimed v4, the next version is {v}"
        assert waiter.expect("got").split()[1] == str(v)
        with pytest.raises(TensorNotFound, match="newer than v5"):
            c.get("v", timeout=0.2, newer_than=v)


# -- M4: leases nobody holds -----------------------------------------------------------------------


@pytest.mark.parametrize("wait", ["waitget later", "waitmany later,later2"])
def test_ctrl_c_in_a_long_poll_leaves_no_lease(
    broker: BrokerProc, mishap: Callable[..., Worker], wait: str
) -> None:
    """A get or get_many waiting on the lane (or over HTTP), cut by Ctrl-C:
    what the broker grants it once its names are put is given back."""
    w = mishap(broker.url)
    w.send(wait)
    w.expect("waiting")  # said just before the call: the get may not be parked yet
    with broker.client() as c:
        # the broker's count of parked gets says the worker is inside its get
        stat_when(c, lambda s: s.sessions == 2 and s.waiting == 1, "the worker's parked get")
        os.kill(w.pid, signal.SIGINT)
        w.expect("interrupted")
        # published after the client gave up
        c.put_many({"later": np.zeros(4, np.float32), "later2": np.ones(4, np.float32)})
        assert w.ask("leases", "n") == "n 0"
        stat_when(c, lambda s: s.leases == 0, "no lease for a wait the client abandoned", 5)
        w.ask("get later", "ok")  # the process carries on
        assert c.stat().leases == 1
        w.send(wait)  # now put: answered at once
        w.expect("waiting")
        assert w.expect("got") == "got 1"


def test_a_request_cancelled_before_it_arrives_never_runs(broker: BrokerProc) -> None:
    """A Ctrl-C cancels the request the client gave up on (its id rides on
    the next request); when the cancel reaches the broker first (it rode on
    another connection, or the request waits in a lane's ring), the request
    is refused on arrival: no lease, no tensor, however often it comes."""
    with broker.client(lane=False) as c:
        c.put("x", np.zeros(4, dtype=np.float32))
        raw = Session(broker.sock)
        assert raw.send("POST", "/v1/release", {"leases": [], "requests": ["r-gone"]})[0] == 200
        for target in ["/v1/tensors/x", "/v1/put/y?dtype=uint8&shape=4"]:
            for _ in range(2):
                a = exchange(
                    broker.sock,
                    encode(
                        "POST" if "put" in target else "GET",
                        target,
                        [(SESSION_HEADER, raw.sid), (REQUEST_HEADER, "r-gone")],
                        b"\0" * 4 if "put" in target else None,
                    ),
                )
                assert (a.status, a.json()["error"]["code"]) == (409, "cancelled"), a
        assert raw.send("GET", "/v1/tensors/x")[0] == 200, "another request of it runs"
        st = c.stat()
        assert (st.leases, st.tensors) == (1, 1), st
        raw.close()
        c.delete("x")
    drained(broker, "leases", "bytes_in_use")


def test_a_ctrl_c_storm_leaks_no_lease_and_leaves_the_client_working(broker: BrokerProc) -> None:
    """A user holding Ctrl-C: SIGINT every 2 ms for 4 s at a worker that gets,
    gets many, puts many, empties and publishes in a loop, catching each
    KeyboardInterrupt.  Once it drops its views, neither its client nor the
    broker holds a lease for it: no release was lost to a Ctrl-C landing in
    a finalizer or in clean-up code, no generator was left half run, and the
    client never hung on a lock a Ctrl-C left held."""
    w = Worker("ctrl_c_storm", broker.url)
    try:
        w.expect("ready")
        end, sent = time.monotonic() + 4, 0
        while time.monotonic() < end and w.proc.poll() is None:
            os.kill(w.pid, signal.SIGINT)
            sent += 1
            time.sleep(0.002)  # the storm's pace, not a wait for a condition
        w.send("stop")
        caught, live, held = map(int, w.expect("left", 60).split()[1:])
        assert w.wait(30) == 0, w.stderr()
        err = w.stderr()
    finally:
        w.close()
    assert caught > sent // 4, f"only {caught} of {sent} SIGINTs interrupted a call"
    assert (live, held) == (0, 0), f"{live} leases left in the client, {held} in the broker"
    # A Ctrl-C may still cut Python's own weakref callbacks short (a WeakSet
    # forgetting an entry); never one of the client's finalizers or a generator.
    ours = [
        ln
        for ln in err.splitlines()
        if "ignored" in ln
        and any(
            n in ln
            for n in (
                "tensordepot",
                "_Lease",
                "Window",
                "Lent",
                "KeptMap",
                "SharedTensor",
                "GeneratorExit",
                "generator",
            )
        )
    ]
    assert not ours, err[-3000:]
    broker.check_clean()
