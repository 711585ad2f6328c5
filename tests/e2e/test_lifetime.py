"""Issue 3: lifetime you can trust.

Real ``tensordepot serve`` processes, real worker processes, real SIGKILL:
nothing here mocks time, processes or shared memory.  Waits poll a
condition with a deadline; killed workers say they are ready first.
"""

from __future__ import annotations

import functools
import gc
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, wait_for
from _harness import stat_when as _stat_when
from _workerio import Worker, metrics, proc_state
from tensordepot import (
    BrokerUnavailable,
    Client,
    InvalidRequest,
    TensorBroken,
    TensorInfo,
    TensorNotFound,
)
from tensordepot._proto import proc_stat
from tensordepot.client._transport import Transport

N = 1 << 18  # float64 elements: 2 MiB, so puts take the alloc + publish path
NBYTES = N * 8
RECLAIM_S = 5.0  # the bound for reclaim after SIGKILL
stat_when = functools.partial(_stat_when, timeout=RECLAIM_S)  # the bound, for every wait here


def names(c: Client) -> set[str]:
    return {i.name for i in c.list()}


def info(c: Client, name: str) -> TensorInfo | None:
    return next((i for i in c.list() if i.name == name), None)


def readers(c: Client, name: str) -> int:
    i = info(c, name)
    assert i is not None, f"{name!r} is not listed"
    return i.readers


def churn(c: Client, n: int = 6, fill: float = 9.0) -> None:
    """Put and delete tensors of the test size, so a range freed too early is reused and
    overwritten."""
    for i in range(n):
        c.put(f"churn{i}", np.full(N, fill))
    for i in range(n):
        c.delete(f"churn{i}")


# -- crashes ---------------------------------------------------------------------------------------


def test_killed_consumer_lease_is_reclaimed(
    broker: BrokerProc, workers: Callable[..., Worker]
) -> None:
    with broker.client() as c:
        c.put("keep", np.ones(1000))
        before = c.stat()
        c.put("w", np.full(N, 3.0))
        h = workers("lifetime_holder", broker.url)
        h.expect("ready")
        h.ask("get w 3 numpy", "got w v1")
        w_info = info(c, "w")
        assert w_info is not None and w_info.readers == 1
        assert c.stat().leases == 1

        c.delete("w")
        assert "w" not in names(c)
        with pytest.raises(TensorNotFound):
            c.get("w")
        held = c.stat()
        assert held.bytes_in_use == before.bytes_in_use + NBYTES, "delete must defer the free"
        assert held.tensors == before.tensors
        churn(c)
        h.ask("check", "ok 1")  # the holder still reads its bytes

        t0 = time.monotonic()
        h.kill()
        # Nobody reaps the worker yet: it stays a zombie, and a zombie is dead.
        wait_for(lambda: proc_state(h.pid) == "Z", 5, what="the killed worker to be a zombie")
        st = stat_when(
            c,
            lambda s: s.leases == 0 and s.bytes_in_use == before.bytes_in_use,
            "the dead consumer's lease and bytes to be reclaimed",
        )
        elapsed = time.monotonic() - t0
        assert elapsed < RECLAIM_S
        assert proc_state(h.pid) == "Z", "reclaimed while the worker was still a zombie"
        assert st.sessions == 1 and st.versions == before.versions, st
    h.wait()


@pytest.mark.parametrize(
    "existing", [pytest.param(False, id="new-name"), pytest.param(True, id="new-version")]
)
def test_killed_producer_write_is_reclaimed(
    broker: BrokerProc, workers: Callable[..., Worker], existing: bool
) -> None:
    with broker.client() as c:
        if existing:
            c.put("half", np.full(N, 1.0))
        before = c.stat()
        w = workers("lifetime_holder", broker.url)
        w.expect("ready")
        version = int(w.ask(f"empty half {N}", "allocated").split()[1])
        assert version == (2 if existing else 1)
        st = c.stat()
        assert (
            st.bytes_in_use == before.bytes_in_use + NBYTES and st.versions == before.versions + 1
        )

        def never_visible() -> None:
            i = info(c, "half")
            if existing:  # readers keep getting the published version 1
                t = c.get("half")
                assert t.version == 1 and np.all(np.from_dlpack(t) == 1.0)
                assert i is not None and (i.version, i.state) == (1, "ready")
            else:
                with pytest.raises(TensorNotFound):
                    c.get("half")
                assert i is None or i.state == "writing", i

        never_visible()
        t0 = time.monotonic()
        w.kill()

        def reclaimed() -> bool:
            never_visible()
            s = c.stat()
            return s.bytes_in_use == before.bytes_in_use and s.versions == before.versions

        wait_for(reclaimed, RECLAIM_S, what="the unpublished allocation to be reclaimed")
        assert time.monotonic() - t0 < RECLAIM_S
        never_visible()
        if not existing:
            assert "half" not in names(c)
    w.wait()


def test_a_broker_starts_beside_a_folder_that_shares_its_prefix(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """The start-up sweep removes its own segments only: a directory in
    /dev/shm whose name starts with the broker's prefix stays, and the broker
    starts."""
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    folder = os.path.join("/dev/shm", f"{prefix}a-folder")
    os.mkdir(folder)
    try:
        with open(os.path.join("/dev/shm", f"{prefix}left"), "wb"):
            pass  # what a dead broker of this prefix left
        b = broker_factory(prefix=prefix)
        assert os.path.isdir(folder)
        assert f"{prefix}left" not in b.segments()
        with b.client() as c:
            c.put("x", np.zeros(4))
            c.delete("x")
    finally:
        os.rmdir(folder)


def test_broker_sigkill(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory()
    c = b.client()
    want = np.arange(N, dtype=np.float64)
    c.put("small", np.arange(10.0))
    c.put("big", want)
    small = np.from_dlpack(c.get("small"))
    big = np.from_dlpack(c.get("big"))

    b.kill()
    b.expect_dead = True  # type: ignore[attr-defined]
    for call in (lambda: c.get("big"), c.list, lambda: c.put("x", np.zeros(3))):
        with pytest.raises(BrokerUnavailable, match="is `tensordepot serve` running"):
            call()
    assert np.array_equal(small, np.arange(10.0)) and np.array_equal(big, want)

    stale = [s for s in b.segments() if not s.endswith("lock")]
    assert stale, "a killed broker leaves its segments behind"
    b2 = broker_factory(sock_dir=b.dir, prefix=b.prefix)
    assert not set(stale) & set(b2.segments()), "the new broker must sweep them before it is ready"
    # Our mapping keeps the unlinked pages: what we received still reads.
    assert np.array_equal(small, np.arange(10.0)) and np.array_equal(big, want)

    with b2.client() as c2:
        c2.put("fresh", np.full(N, 2.0))
        assert np.all(np.from_dlpack(c2.get("fresh")) == 2.0)
        with pytest.raises(TensorNotFound):
            c2.get("big")
    # The old client opens a new session on the new broker by itself.
    c.put("again", np.full(N, 4.0))
    assert np.all(np.from_dlpack(c.get("again")) == 4.0)
    assert np.array_equal(big, want)

    # close() waits for views of the dead broker's memory too, then ends the session.
    c.close()
    del small, big
    with b2.client() as probe:
        stat_when(
            probe, lambda s: s.sessions == 1 and s.leases == 0, "the old client's session to end"
        )


def test_leases_of_a_dead_broker_never_release_new_ones(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """Lease ids restart with each broker.  A view from a dead broker that dies
    late must not release the new broker's lease that has the same number."""
    b1 = broker_factory()
    x1, x2 = b1.client(), b1.client()
    x1.put("old", np.full(N, 1.0))
    old1 = np.from_dlpack(x1.get("old"))  # lease 1 of the first broker
    old2 = np.from_dlpack(x2.get("old"))  # lease 2
    b1.kill()
    b1.expect_dead = True  # type: ignore[attr-defined]

    b2 = broker_factory(sock_dir=b1.dir, prefix=b1.prefix)
    with b2.client() as y:
        y.put("y", np.full(N, 5.0))
        ty = np.from_dlpack(y.get("y"))  # lease 1 of the new broker: old1's number
        y.delete("y")  # a wrong release would free its bytes at once
        x2.put("z", np.full(N, 6.0))  # x2 opens a new session here
        tz = np.from_dlpack(x2.get("z"))  # lease 2: old2's number, in x2's own new session
        x2.delete("z")
        x2.put("p", np.zeros(4))
        probe = x2.get("p")  # lease 3
        assert y.stat().leases == 3

        # x2: the stale release is queued before the probe's; once the probe's
        # release has landed, the stale one has been handled too.
        del old2
        gc.collect()
        del probe
        wait_for(lambda: readers(y, "p") == 0, RECLAIM_S, what="the probe's release")
        assert y.stat().leases == 2, "a release of the dead broker's lease 2 ended x2's new lease 2"

        # x1 never talked to the new broker: its release carries its dead session.
        # close() with no live view returns after every release was sent.
        del old1
        gc.collect()
        x1.close()
        st = y.stat()
        assert st.leases == 2, "x1's release of the dead broker's lease 1 ended y's lease 1"
        assert st.bytes_in_use == 2 * NBYTES + 32, st

        churn(y)
        assert np.all(ty == 5.0) and np.all(tz == 6.0)
        del ty, tz
        stat_when(y, lambda s: s.leases == 0 and s.bytes_in_use == 32, "the last leases to end")
    x2.close()


def test_close_collects_a_view_caught_in_a_reference_cycle(broker: BrokerProc) -> None:
    """close() collects garbage while leases are held: a view that only a
    reference cycle keeps (a traceback's frames, a model's graph) is freed,
    and the session ends with the call."""
    with broker.client() as other:
        c = broker.client()
        c.put("cyc", np.arange(N, dtype=np.float64))
        gc.disable()  # nothing but close() collects the cycle
        try:
            loop: list[Any] = [np.from_dlpack(c.get("cyc"))]
            loop.append(loop)
            del loop
            assert other.stat().leases == 1
            c.close()
            st = other.stat()
            assert st.leases == 0 and st.sessions == 1, st
        finally:
            gc.enable()
        other.delete("cyc")
        stat_when(other, lambda s: s.bytes_in_use == 0, "the tensor to be freed")


def test_release_takes_only_own_leases(broker: BrokerProc) -> None:
    t = Transport(broker.url)
    try:

        def session() -> dict[str, str]:
            sid = t.request("POST", "/v1/sessions", {"pid": os.getpid()})["session"]
            return {"x-tensordepot-session": sid}

        a, other = session(), session()
        t.request("POST", "/v1/put/x?dtype=float32&shape=2", bytes(8), headers=a)
        lease = t.request("GET", "/v1/tensors/x", headers=a)["lease"]
        for headers in (other, {"x-tensordepot-session": "0" * 32}, {}):
            got = t.request("POST", "/v1/release", {"leases": [lease]}, headers=headers)
            assert got == {"released": 0}, headers
        assert broker.stat().leases == 1
        assert t.request("POST", "/v1/release", {"leases": [lease]}, headers=a) == {"released": 1}
        for headers in (a, other):
            t.request("DELETE", f"/v1/sessions/{headers['x-tensordepot-session']}")
    finally:
        t.close()


# -- deferred delete, views, ttl -------------------------------------------------------------------


def test_delete_while_readers_hold(broker: BrokerProc, workers: Callable[..., Worker]) -> None:
    with broker.client() as c:
        c.put("keep", np.ones(1000))
        before = c.stat()
        c.put("d", np.full(N, 4.0))
        h1 = workers("lifetime_holder", broker.url)
        h2 = workers("lifetime_holder", broker.url)
        h1.expect("ready")
        h2.expect("ready")
        h1.ask("get d 4 numpy", "got d v1")
        h2.ask("get d 4 torch", "got d v1")
        mine = np.from_dlpack(c.get("d"))
        d_info = info(c, "d")
        assert d_info is not None and d_info.readers == 3

        c.delete("d")
        # The name is gone at once ...
        assert "d" not in names(c)
        with pytest.raises(TensorNotFound):
            c.get("d")
        assert c.stat().tensors == before.tensors
        # ... the bytes are not.
        churn(c)
        assert np.all(mine == 4.0)
        h1.ask("check", "ok 1")
        h2.ask("check", "ok 1")
        assert c.stat().bytes_in_use == before.bytes_in_use + NBYTES

        h1.ask("drop d", "dropped")  # one holder lets go
        st = stat_when(c, lambda s: s.leases == 2, "h1's release")
        assert st.bytes_in_use == before.bytes_in_use + NBYTES
        h2.kill()  # another one dies
        st = stat_when(c, lambda s: s.leases == 1, "h2's lease to be reclaimed")
        assert st.bytes_in_use == before.bytes_in_use + NBYTES
        assert np.all(mine == 4.0)
        del mine  # the last one lets go: now the memory is freed
        stat_when(
            c,
            lambda s: s.leases == 0 and s.bytes_in_use == before.bytes_in_use,
            "the deleted tensor's memory to be freed",
        )
    h2.wait()


def test_torch_view_outlives_shared_tensor(broker: BrokerProc) -> None:
    torch = pytest.importorskip("torch")
    want = torch.arange(N, dtype=torch.float64)
    with broker.client() as c:
        c.put("keep", np.zeros(4))
        base = c.stat().bytes_in_use
        c.put("x", want)
        t = c.get("x")
        x = torch.from_dlpack(t)
        part = x[10:20]  # a view of the view: it shares the storage, so it holds the lease too
        probe = c.get("keep")
        del t
        gc.collect()
        c.delete("x")
        # Any release from dropping `t` was queued before the probe's.
        del probe
        wait_for(lambda: readers(c, "keep") == 0, RECLAIM_S, what="the probe's release")
        st = c.stat()
        assert st.leases == 1 and st.bytes_in_use == base + NBYTES, (
            "the torch tensor must keep the lease"
        )
        churn(c)
        assert torch.equal(x, want), (
            "the torch tensor must stay valid after the SharedTensor is gone"
        )
        del x
        gc.collect()
        churn(c)
        assert torch.equal(part, want[10:20])
        assert c.stat().leases == 1
        del part  # the lease ends when the last torch tensor is freed
        stat_when(
            c, lambda s: s.leases == 0 and s.bytes_in_use == base, "the torch tensor's lease to end"
        )


@pytest.mark.parametrize("n", [pytest.param(16, id="inline"), pytest.param(N, id="alloc")])
def test_ttl_expires(broker: BrokerProc, n: int) -> None:
    with broker.client() as c:
        c.put("keep", np.zeros(4))
        base = c.stat().bytes_in_use
        t0 = time.monotonic()
        c.put("t", np.full(n, 8.0), ttl=1)
        i = info(c, "t")
        assert i is not None and i.expires_in is not None and 0 < i.expires_in <= 1
        held = np.from_dlpack(c.get("t"))  # a reader across the expiry keeps its bytes

        wait_for(lambda: "t" not in names(c), 5, what="the ttl=1 tensor to expire")
        elapsed = time.monotonic() - t0
        assert 0.95 <= elapsed < 5, f"expired after {elapsed:.2f} s"
        with pytest.raises(TensorNotFound):
            c.get("t")
        assert names(c) == {"keep"}
        assert c.stat().bytes_in_use == base + n * 8
        churn(c)
        assert np.all(held == 8.0)
        del held
        stat_when(
            c, lambda s: s.leases == 0 and s.bytes_in_use == base, "the expired tensor to be freed"
        )


# -- shutdown --------------------------------------------------------------------------------------


def test_sigterm_wakes_waiting_get(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker]
) -> None:
    b = broker_factory()
    with b.client() as c:
        c.put("some", np.zeros(N))
    w = workers("lifetime_waiter", b.url, "never")
    w.expect("waiting")
    wait_for(
        lambda: metrics(b.url).get("tensordepot_waits_total", 0) >= 1,
        10,
        what="the waiter's get to be parked in the broker",
    )

    assert b.proc is not None
    t0 = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    line = w.expect("unavailable", timeout=10)
    woke = time.monotonic() - t0
    assert woke < 3, f"the waiting get took {woke:.2f} s to fail"
    assert "shutting down" in line, line
    w.expect("after")
    assert w.wait() == 0, w.stderr()
    assert b.stop() == 0, b.log()  # exit status 0 after SIGTERM
    b.expect_dead = True  # type: ignore[attr-defined]
    assert b.segments() == [], b.segments()
    assert not os.path.exists(b.sock)


# -- accounting ------------------------------------------------------------------------------------


def _cli(url: str, *args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "tensordepot", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_stat_and_tensor_info(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("a", np.zeros(1000))  # 8000 bytes
        c.put("b", np.ones((256, 1024), np.float32))  # 1 MiB
        w = c.empty("c", (10,), "float64")  # 80 bytes, never published
        a1, a2 = c.get("a"), c.get("a")
        st = c.stat()
        # Three leases: two readers of "a", and the writer's own hold on "c".
        assert (st.bytes_in_use, st.tensors, st.leases, st.sessions) == (
            8000 + (1 << 20) + 80,
            2,
            3,
            1,
        )

        by_name = {i.name: i for i in c.list()}
        assert {n: (i.state, i.readers) for n, i in by_name.items()} == {
            "a": ("ready", 2),
            "b": ("ready", 0),
            "c": ("writing", 0),
        }

        out = _cli(broker.url, "stat", "--bytes")
        shown = dict(line.split(None, 1) for line in out.splitlines())
        # The CLI's own session is one more.
        assert (
            int(shown["bytes_in_use"]),
            int(shown["tensors"]),
            int(shown["leases"]),
            int(shown["sessions"]),
        ) == (st.bytes_in_use, 2, 3, 2), out

        rows = {line.split()[0]: line.split() for line in _cli(broker.url, "ls").splitlines()}
        assert rows["NAME"][-2:] == ["READERS", "STATE"]
        assert rows["a"][-2:] == ["2", "ready"] and rows["c"][-2:] == ["0", "writing"]

        del a1, a2, w
    with broker.client() as c:  # the unpublished "c" ended with its session
        assert names(c) == {"a", "b"}
        assert c.stat().bytes_in_use == 8000 + (1 << 20)


# -- sessions --------------------------------------------------------------------------------------


def test_close_keeps_session_while_views_live(
    broker: BrokerProc, workers: Callable[..., Worker]
) -> None:
    with broker.client() as probe:
        c = broker.client()
        c.put("x", np.full(N, 2.0))
        view = np.from_dlpack(c.get("x"))
        c.close()
        with pytest.raises(InvalidRequest, match="closed"):
            c.list()
        st = probe.stat()
        assert (st.sessions, st.leases) == (2, 1), "close() must not pull memory from a live view"
        churn(probe)
        assert np.all(view == 2.0)
        del view
        stat_when(
            probe,
            lambda s: s.sessions == 1 and s.leases == 0,
            "the session to end with its last view",
        )

        c = broker.client()
        c.close()  # no live view: the session ends before close() returns
        assert probe.stat().sessions == 1

        # A process that closes its client with a view alive, then exits normally.
        h = workers("lifetime_holder", broker.url)
        h.expect("ready")
        h.ask("get x 2 numpy", "got x")
        h.ask("close", "closed")
        h.ask("check", "ok 1")
        st = probe.stat()
        assert (st.sessions, st.leases) == (2, 1)
        h.ask("exit", "bye")
        assert h.wait() == 0
        stat_when(
            probe,
            lambda s: s.sessions == 1 and s.leases == 0,
            "the exited process's session to end",
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_untracked_session_needs_heartbeats(broker_factory: Callable[..., BrokerProc]) -> None:
    """Over TCP the broker cannot read the peer's pid, and a pid a client merely
    claims is never trusted (not even with its real start time, or pid 1): such
    sessions live on heartbeats."""
    tcp = f"http://127.0.0.1:{_free_port()}"
    b = broker_factory("--listen", tcp, "--session-ttl", "1", "--insecure-no-auth")
    with Client(tcp) as honest:
        assert not honest._session.tracked, "a pid claimed over TCP must not make a session tracked"
    t = Transport(tcp)
    try:

        def session(pid: int, start: int | None) -> tuple[dict[str, str], dict[str, Any]]:
            info = t.request("POST", "/v1/sessions", {"pid": pid, "start_time": start})
            return {"x-tensordepot-session": info["session"]}, info

        beating, info1 = session(1, _start_time(1))  # pid 1 with its real start time
        silent, info2 = session(os.getpid(), None)
        for i in (info1, info2):
            assert not i["tracked"] and i["heartbeat_interval"] == pytest.approx(1 / 3)
        t.request("POST", "/v1/put/x?dtype=float32&shape=2", bytes(8), headers=beating)
        for headers in (beating, silent):
            t.request("GET", "/v1/tensors/x", headers=headers)

        t0 = time.monotonic()

        def silent_reaped() -> bool:
            t.request(
                "POST",
                f"/v1/sessions/{beating['x-tensordepot-session']}/heartbeat",
                headers=beating,
            )
            st = b.stat()
            return st.leases == 1 and st.sessions == 2  # `beating` and the stat's own

        wait_for(silent_reaped, 10, interval=0.1, what="the silent session to be reaped")
        assert time.monotonic() - t0 >= 0.9, "reaped before its heartbeat ttl"
        t.request("DELETE", f"/v1/sessions/{beating['x-tensordepot-session']}", headers=beating)
    finally:
        t.close()


def test_heartbeats_outlive_a_background_chore_that_fails(
    broker_factory: Callable[..., BrokerProc], caplog: pytest.LogCaptureFixture
) -> None:
    """The client's background thread runs its chores (releases, heartbeats,
    forgetting unlinked segments) each on its own: one that raises what nobody
    foresaw (here, forgetting segments, which also asks the GPU code) is logged
    and tried again, and the heartbeats go on, so the session does not lapse
    under a live view."""
    tcp = f"http://127.0.0.1:{_free_port()}"
    b = broker_factory("--listen", tcp, "--session-ttl", "1", "--insecure-no-auth")
    failures = []

    def prune() -> None:
        failures.append(time.monotonic())
        raise RuntimeError("an unforeseen failure")

    with Client(tcp) as c:
        c.put("x", np.arange(4, dtype=np.float32))
        view = np.from_dlpack(c.get("x"))
        sid = c._core.sid
        c._core.prune = prune  # type: ignore[method-assign]
        deadline = time.monotonic() + 4  # four heartbeat TTLs
        while time.monotonic() < deadline:
            lapsed = metrics(b.url).get("tensordepot_sessions_lapsed_total", 0)
            assert lapsed == 0 and c._core.sid == sid, "the session lapsed under a live view"
            time.sleep(0.1)
        assert len(failures) >= 2, "the failing chore was not tried again"
        assert any("failed; it tries again" in r.getMessage() for r in caplog.records)
        del c._core.prune
        assert view.tolist() == [0, 1, 2, 3]
        del view
        c.delete("x")
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().bytes_in_use == 0,
            10,
            what="the lease and the bytes to be given back",
        )


def _start_time(pid: int) -> int | None:
    ident = proc_stat(pid)
    return None if ident is None else ident[0]


def _fork_with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """Start a process that gets ``pid`` (needs CAP_SYS_ADMIN for ns_last_pid)."""
    for _ in range(20):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        if p.pid == pid:
            return p
        p.stdin.close()  # type: ignore[union-attr]
        p.wait()  # another process on the host took the pid first: try again
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="reusing a pid needs root (ns_last_pid)")
def test_reused_pid_does_not_keep_session_alive(
    broker: BrokerProc, workers: Callable[..., Worker]
) -> None:
    """The broker tracks a session by pid *and* start time: a new process
    with the dead client's pid must not keep its session alive."""
    assert broker.proc is not None
    with broker.client() as c:
        c.put("x", np.full(N, 1.0))
        h = workers("lifetime_holder", broker.url)
        h.expect("ready")
        h.ask("get x 1 numpy", "got x")
        assert c.stat().leases == 1
        # Freeze the broker so it cannot notice the gap between the death and the reuse.
        broker.proc.send_signal(signal.SIGSTOP)
        impostor = None
        try:
            wait_for(
                lambda: proc_state(broker.proc.pid) == "T",
                5,  # type: ignore[union-attr]
                what="the broker to stop",
            )
            h.kill()
            h.wait()
            impostor = _fork_with_pid(h.pid)
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        if impostor is None:
            pytest.skip("could not start a process with the dead worker's pid")
        try:
            # The pid is alive again (running, sleeping, or briefly in disk sleep) ...
            assert proc_state(h.pid) in ("S", "R", "D")
            # ... but it is not the process that opened the session.
            stat_when(
                c, lambda s: s.leases == 0 and s.sessions == 1, "the dead session to be reaped"
            )
            assert impostor.poll() is None
        finally:
            impostor.stdin.close()  # type: ignore[union-attr]
            impostor.wait()


def test_an_empty_dropped_unpublished_gives_its_memory_back_at_once(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """An ``empty()`` whose views are all gone can never be published: its
    memory and quota come back when its hold is released, not after
    --alloc-ttl, so the retry after an error between ``empty()`` and
    ``publish()`` fits; a ``delete`` of its name reclaims it too."""
    b = broker_factory("--max-memory-per-session", "3MiB")
    with b.client() as c:
        for _ in range(4):  # each try fails before publish; the next one must fit
            out = c.empty("w", (2 << 20,), "uint8")
            np.from_dlpack(out)[:] = 1
            del out
        out = c.empty("w", (2 << 20,), "uint8")
        np.from_dlpack(out)[:] = 7
        out.publish()
        del out
        assert np.from_dlpack(c.get("w"))[0] == 7
        wait_for(
            lambda: c.stat().bytes_in_use == 2 << 20 and c.stat().leases == 0,
            10,
            what="only the published version to hold memory",
        )
        held = c.empty("x", (1 << 20,), "uint8")
        c.delete("x")  # the writer still holds its view: freed when it lets go
        with pytest.raises(TensorBroken, match="allocation is gone"):
            held.publish()
        del held
        wait_for(lambda: c.stat().bytes_in_use == 2 << 20, 10, what="the deleted write's memory")
        c.delete("w")
    b.check_clean()
