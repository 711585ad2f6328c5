"""Sessions bound to their process, and retired memory that comes back, tried
against a real broker with real worker processes.

A session id used by another process of the same user is refused (403), and
the owner's views keep their bytes; memory retired because the broker could
not vouch for a holder comes back once the holder is proven gone, or after a
bounded grace (a lapsed heartbeat session or unclaimed fork, an empty()
past --alloc-ttl); a process that exits normally is not counted as a crash.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _harness import WORKERS, BrokerProc, drained, free_port, stat_when, wait_for
from _rawhttp import Answer, encode, exchange
from _workerio import Worker, metrics
from tensordepot import Client, OutOfMemory
from tensordepot._proto import SESSION_HEADER

MiB = 1 << 20
N = MiB // 4  # float32 elements of a 1 MiB tensor (a pooled block)


# -- 1. a session id works only from the process that opened it ------------------------------


STOLEN = ("heartbeat", "release", "piggyback", "put", "fork", "get", "close")


def steal(b: BrokerProc, sid: str, lease: int | None) -> dict[str, list[object]]:
    """What another process of this user got, using session ``sid``."""
    argv = [sys.executable, str(WORKERS / "session_thief.py"), b.sock, sid, str(lease)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_session_id_used_by_another_process_of_the_same_user_is_403(broker: BrokerProc) -> None:
    with broker.client() as owner:
        owner.put("w", np.arange(N, dtype=np.float32))
        t = owner.get("w")
        view, want = np.from_dlpack(t), np.arange(N, dtype=np.float32).tobytes()
        tried = steal(broker, owner._sid, t._lease_id())
        refused = [what for what in STOLEN if tried[what][:2] == [403, "forbidden"]]
        assert refused == list(STOLEN), tried
        why = tried["heartbeat"][2]
        assert f"belongs to pid {os.getpid()}" in why and "opens its own session" in why, why
        st = owner.stat()
        assert st.leases == 1, st
        owner.delete("w")  # only the owner's lease keeps the bytes now
        for i in range(4):  # churn: a range freed too early would be overwritten here
            owner.put(f"c{i}", np.full(N, -1.0, dtype=np.float32))
        assert view.tobytes() == want, "the owner's view changed"
        for i in range(4):
            owner.delete(f"c{i}")
        del t, view
        drained(owner, "leases", "bytes_in_use", "bytes_retired", sessions=1)


# -- 2. retired memory comes back --------------------------------------------------------------

GRACE = 3.0  # --lapse-grace in these tests (60 s by default)


def tcp_reader(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker]
) -> tuple[Worker, Client]:
    """A broker on TCP (--session-ttl 1, --lapse-grace GRACE), a reader
    worker on it, and a client of the test's own."""
    tcp = f"http://127.0.0.1:{free_port()}"
    token = {"TENSORDEPOT_TOKEN": secrets.token_urlsafe(24)}
    # Through the environment, so an older broker that lacks the setting starts too.
    broker_factory(
        "--listen", tcp, "--session-ttl", "1", env={**token, "TENSORDEPOT_LAPSE_GRACE": str(GRACE)}
    )
    w = workers("mishap", tcp, env=token)
    w.expect("ready")
    return w, Client(tcp, token=token["TENSORDEPOT_TOKEN"])


def test_a_lapsed_tcp_session_s_memory_comes_back_after_the_grace(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker]
) -> None:
    """A TCP reader SIGSTOPped past --session-ttl lapses: what it leased is
    retired.  SIGKILLed then, nothing tells the broker; its memory comes back
    --lapse-grace after the lapse, not before."""
    w, c = tcp_reader(broker_factory, workers)
    with c:
        c.put("keep", np.full(N, 1.0, dtype=np.float32))  # keeps the segment from being unlinked
        c.put("a", np.full(N, 2.0, dtype=np.float32))
        w.ask("get a", "ok")
        os.kill(w.pid, signal.SIGSTOP)
        stat_when(c, lambda s: s.sessions == 1, "the paused session to lapse")
        lapsed = time.monotonic()
        w.kill()
        w.wait()
        c.delete("a")
        st = c.stat()
        assert st.bytes_retired == MiB, st  # retired, not reused, while the grace runs
        stat_when(
            c,
            lambda s: s.bytes_retired == 0,
            "the lapsed session's memory to come back",
            GRACE + 10,
        )
        assert time.monotonic() - lapsed >= GRACE - 0.5, "given back before the grace"
        c.delete("keep")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


@pytest.mark.parametrize("closed", [False, True], ids=["carries_on", "closed_its_client"])
def test_a_lapsed_reader_that_resumes_keeps_its_views_past_the_grace(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker], closed: bool
) -> None:
    """A TCP reader SIGSTOPped past --session-ttl lapses, then resumes with its
    view alive.  Its heartbeats say which lapsed session its views still hold,
    so the grace never runs out under a live view: puts long past the grace
    never reuse those bytes.  Once the view is dropped, the memory comes back.
    ``closed``: the reader closed its client before the pause (a closed client's
    views keep their leases), so it makes no request after it resumes."""
    w, c = tcp_reader(broker_factory, workers)
    with c:
        c.put("keep", np.full(N, 1.0, dtype=np.float32))
        c.put("a", np.full(N, 2.0, dtype=np.float32))
        w.ask("get a", "ok")
        if closed:
            w.ask("close", "ok")
        os.kill(w.pid, signal.SIGSTOP)
        stat_when(c, lambda s: s.sessions == 1, "the paused session to lapse")
        lapsed = time.monotonic()
        os.kill(w.pid, signal.SIGCONT)
        if not closed:
            w.ask("put mine 1 3.0", "ok")  # the reader carries on, in a new session
        c.delete("a")
        i = 0
        while time.monotonic() - lapsed < GRACE + 3:  # puts that would take the freed bytes
            c.put(f"churn{i % 4}", np.full(N, 9.0, dtype=np.float32))
            i += 1
        got = w.ask("check a", "")
        assert got == "same", f"a resumed reader's view saw another tensor's bytes: {got}"
        assert c.stat().bytes_retired == MiB
        w.ask("drop a", "ok")  # the view is gone: the client says so, the memory comes back
        stat_when(c, lambda s: s.bytes_retired == 0, "the dropped view's memory to come back", 10)
        if not closed:
            w.ask("drop mine", "ok")
        w.close()
        names = ["keep", *{f"churn{j % 4}" for j in range(i)}] + ([] if closed else ["mine"])
        for name in names:
            c.delete(name)
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


def test_a_unix_reader_stopped_past_the_ttl_then_killed_gives_its_memory_back_at_once(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker]
) -> None:
    """On the unix socket the broker knows the reader's pid: SIGSTOPped past
    --session-ttl it is paused, not gone, and keeps its session and its bytes;
    SIGKILLed, it is gone, and its memory is reused within --reap-interval,
    never retired."""
    b = broker_factory("--session-ttl", "1")
    w = workers("mishap", b.url)
    w.expect("ready")
    with b.client() as c:
        c.put("keep", np.full(N, 1.0, dtype=np.float32))
        c.put("a", np.full(N, 2.0, dtype=np.float32))
        w.ask("get a", "ok")
        os.kill(w.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(
            lambda: time.monotonic() - stopped > 2 and c.stat().sessions == 2,
            10,
            what="the stopped reader's session to outlive --session-ttl",
        )
        c.delete("a")
        assert c.stat().bytes_in_use == 2 * MiB  # the stopped reader still holds 'a'
        w.kill()
        w.wait()
        killed = time.monotonic()
        st = stat_when(
            c,
            lambda s: s.sessions == 1 and s.bytes_in_use == MiB,
            "the killed reader's memory to come back",
            5,
        )
        assert (st.bytes_retired, st.retired_total) == (0, 0), st
        assert time.monotonic() - killed < 2, "slower than --reap-interval allows"
        c.delete("keep")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


def test_a_fork_never_claimed_gives_its_memory_back_after_the_grace(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """POST /fork copies the leases into a session for a child; a child that
    never claims it (it exited, or was paused right after the fork) lapses at
    the end of the claim window: what the copies held is retired, and comes
    back --lapse-grace later, as for any lapsed session."""
    from _rawhttp import encode, exchange

    b = broker_factory(env={"TENSORDEPOT_LAPSE_GRACE": str(GRACE)})
    with b.client() as c:
        c.put("keep", np.full(N, 1.0, dtype=np.float32))
        c.put("a", np.full(N, 2.0, dtype=np.float32))
        t = c.get("a")
        got = exchange(
            b.sock,
            encode("POST", f"/v1/sessions/{c._sid}/fork", [("x-tensordepot-session", c._sid)], b""),
        )
        assert got.status == 200, got
        assert len(got.json()["leases"]) == 1, got.json()
        del t
        c.delete("a")
        assert c.stat().bytes_in_use == 2 * MiB  # the unclaimed copy holds 'a'
        stat_when(c, lambda s: s.sessions == 1, "the unclaimed fork to lapse (claim window)", 20)
        lapsed = time.monotonic()
        st = c.stat()
        assert st.bytes_retired == MiB, st  # retired, not reused, while the grace runs
        st = stat_when(
            c,
            lambda s: s.bytes_in_use == MiB and s.bytes_retired == 0,
            "the unclaimed fork's memory to come back",
            GRACE + 10,
        )
        assert time.monotonic() - lapsed >= GRACE - 0.5, "given back before the grace"
        assert st.retired_total >= MiB, st  # it was retired, then came back
        c.delete("keep")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


# -- 3. an empty() past --alloc-ttl ------------------------------------------------------------


@pytest.mark.parametrize("how", ["released", "killed"])
def test_an_expired_empty_comes_back_once_its_hold_ends(
    broker_factory: Callable[..., BrokerProc], workers: Callable[..., Worker], how: str
) -> None:
    """An empty() left unpublished past --alloc-ttl is reclaimed, its memory
    distrusted while the writer's views live.  Once the hold is released (the
    views died) or the writer is gone, the memory is reused."""
    b = broker_factory(env={"TENSORDEPOT_ALLOC_TTL": "1"})
    w = workers("mishap", b.url)
    w.expect("ready")
    with b.client() as c:
        c.put("keep", np.full(N, 1.0, dtype=np.float32))
        w.ask(f"hold a {N} 1.0", "ok")
        wait_for(lambda: "a" not in {i.name for i in c.list()}, 10, what="'a' to expire")
        if how == "released":
            w.ask("drop a", "ok")
        else:
            w.kill()
            w.wait()
        stat_when(c, lambda s: s.leases == 0 and s.bytes_in_use == MiB, "the hold to end")
        stat_when(c, lambda s: s.bytes_retired == 0, "the expired write's memory to come back", 5)
        if how == "released":
            w.send("exit")
            assert w.wait() == 0, w.stderr()
        c.delete("keep")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


# -- 4. a clean exit is not a crash --------------------------------------------------------------


REAPED, EXITED = "tensordepot_sessions_reaped_total", "tensordepot_sessions_exited_total"


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_a_process_that_exits_with_a_view_alive_is_not_counted_as_a_crash(
    broker: BrokerProc, workers: Callable[..., Worker], how: str
) -> None:
    """A process that exits normally, a view still alive, ends its session on
    its way out (the client's exit hook): counted as exited, not reaped, and
    no "is gone; reclaiming" line.  A SIGKILLed one is a crash: reaped, logged."""
    with broker.client() as c:
        c.put("x", np.full(N, 2.0, dtype=np.float32))
        before = metrics(broker.url)
        h = workers("lifetime_holder", broker.url)
        pid = int(h.expect("ready").split()[1])
        h.ask("get x 2 numpy", "got x")
        if how == "exits":
            h.ask("exit", "bye")
        else:
            h.kill()
        h.wait()
        stat_when(c, lambda s: s.sessions == 1 and s.leases == 0, "the worker's session to end")
        after = metrics(broker.url)
        reaped = after.get(REAPED, 0) - before.get(REAPED, 0)
        exited = after.get(EXITED, 0) - before.get(EXITED, 0)
        crash_lines = [
            ln for ln in broker.log().splitlines() if f"(pid {pid}) is gone; reclaiming" in ln
        ]
        if how == "exits":
            assert (reaped, exited, crash_lines) == (0, 1, []), (reaped, exited, crash_lines)
        else:
            assert (reaped, exited, len(crash_lines)) == (1, 0, 1), (reaped, exited, crash_lines)
        c.delete("x")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
def test_five_normal_exits_with_views_past_close_are_no_crash_and_a_kill_is_one(
    broker: BrokerProc,
) -> None:
    """The ordinary ``with Client() as c:`` with a view kept past it, in a
    script and in the children multiprocessing and a DataLoader start (which
    leave with os._exit, never running atexit): 0 reaped, all exited; then a
    SIGKILL is 1 reaped."""
    with broker.client() as c:
        c.put("x", np.full(N, 2.0, dtype=np.float32))
        before = metrics(broker.url)
        res = subprocess.run(
            [sys.executable, str(WORKERS / "exits.py"), broker.url],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0 and res.stdout == "done\n", res.stderr[-3000:]
        stat_when(c, lambda s: s.sessions == 1 and s.leases == 0, "the sessions to end")
        after = metrics(broker.url)
        reaped = after.get(REAPED, 0) - before.get(REAPED, 0)
        exited = after.get(EXITED, 0) - before.get(EXITED, 0)
        # 5 sessions of their own, and 2 forked children's copies of the
        # script's leases (its view lives across both forks): 7 exits, 0 crashes
        assert (reaped, exited) == (0, 7), (reaped, exited, broker.log()[-2000:])
        assert "is gone; reclaiming" not in broker.log()
        killed = subprocess.Popen(
            [sys.executable, "-c", KEEP_AND_WAIT, broker.url], stdout=subprocess.PIPE, text=True
        )
        assert killed.stdout is not None and killed.stdout.readline() == "holding\n"
        killed.kill()
        killed.wait(30)
        killed.stdout.close()
        stat_when(c, lambda s: s.sessions == 1 and s.leases == 0, "the killed session to end")
        last = metrics(broker.url)
        assert last.get(REAPED, 0) - after.get(REAPED, 0) == 1
        assert last.get(EXITED, 0) == after.get(EXITED, 0)
        c.delete("x")
        drained(c, "leases", "bytes_in_use", "bytes_retired", sessions=1)


KEEP_AND_WAIT = """
import sys, time
from tensordepot import Client
with Client(sys.argv[1]) as c:
    t = c.get("x")
print("holding", flush=True)
time.sleep(3600)
"""


# -- 5. what a reader pins is the reader's ------------------------------------------------


def _producer_and_reader(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path, **kw: object
) -> tuple[str, str, str]:
    """A TCP broker with a write token and a read token, and a 3 MiB quota per
    token: (its URL, the producer's token, the reader's)."""
    producer, reader = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    fd = os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{producer} write name=producer\n{reader} read name=reader\n")
    tcp = f"http://127.0.0.1:{free_port()}"
    broker_factory(
        "--listen", tcp, "--token-file", str(tokens), "--max-memory-per-token", "3MiB", **kw
    )
    return tcp, producer, reader


def test_versions_a_reader_pins_do_not_count_against_the_producer(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    """A reader that keeps every version it got pins what the producer has
    replaced; those bytes count against the reader, so the producer's
    --max-memory-per-token holds only what its names still refer to.  Once
    the reader's pins fill its own quota, its gets are refused (507) until it
    lets go: it cannot hold the broker's memory without bound."""
    tcp, producer, reader = _producer_and_reader(broker_factory, tmp_path)
    with Client(tcp, token=producer) as p, Client(tcp, token=reader) as r:
        kept, refused = [], 0
        for i in range(6):  # the producer's fourth put was refused when pins were its own
            p.put("w", np.full(N, float(i), dtype=np.float32))
            try:
                kept.append(np.from_dlpack(r.get("w")))
            except OutOfMemory as exc:
                assert "replaced or deleted hold 3145728 bytes" in str(exc), exc
                refused += 1
        assert [float(k[0]) for k in kept] == [0.0, 1.0, 2.0] and refused == 3
        assert p.stat().bytes_in_use == 4 * MiB  # 3 pinned by the reader, and the current one
        del kept
        wait_for(lambda: p.stat().bytes_in_use == MiB, 10, what="the pinned versions to go")
        assert float(np.from_dlpack(r.get("w"))[0]) == 5.0  # room again
        p.delete("w")
        wait_for(lambda: p.stat().bytes_in_use == 0, 10, what="the last version to go")


def test_the_pins_of_an_unclaimed_fork_count_against_the_forker_not_the_producer(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    """A read token may fork its session (a read-only consumer's DataLoader
    forks its workers).  The copies of its leases that a child never claims
    pin the versions the producer replaces: those bytes count against the
    forker's quota, so the producer keeps publishing under its own (and once
    they fill the forker's quota, its gets are refused), and they come back
    --lapse-grace after the claim window."""
    tcp, producer, reader = _producer_and_reader(
        broker_factory, tmp_path, env={"TENSORDEPOT_LAPSE_GRACE": "2"}
    )
    with Client(tcp, token=producer) as p, Client(tcp, token=reader) as r:
        refused = 0
        for i in range(6):  # 6 MiB pinned by forks were a 3 MiB quota of the producer's
            p.put("w", np.full(N, float(i), dtype=np.float32))
            try:
                t = r.get("w")
            except OutOfMemory:  # the forks' pins fill the reader's own 3 MiB
                refused += 1
                continue
            fork = r._call("POST", f"/v1/sessions/{r._sid}/fork")
            assert str(t._lease_id()) in fork["leases"], fork  # the child's copy of t's lease
            del t  # the reader lets go; only the unclaimed child's copy holds version i
        st = p.stat()
        assert (st.tensors, st.bytes_in_use, refused) == (1, 4 * MiB, 3), st
        p.delete("w")
        # The forks' claim window ends, then their copies' memory comes back.
        wait_for(
            lambda: (
                p.stat().bytes_in_use == 0 and p.stat().bytes_retired == 0 and p.stat().leases == 0
            ),
            30,
            what="the unclaimed forks' pins to go",
        )
        assert r.stat().sessions == 2  # the producer's and the reader's: the forks ended


def test_a_release_sent_under_a_lapsed_session_gives_its_memory_back(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    """A process resumes from a pause past --session-ttl and drops a view
    before its heartbeat finds the session gone: the release goes out under
    the lapsed session's id.  The broker takes it as the client's word that
    the view is gone (as a stale release), so the retired memory comes back
    now, not --lapse-grace later."""
    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens"
    fd = os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{token} write name=resumed\n")
    port = free_port()
    broker_factory(
        "--listen",
        f"http://127.0.0.1:{port}",
        "--token-file",
        str(tokens),
        "--session-ttl",
        "1",
        "--lapse-grace",
        "120",
    )
    auth = [("Authorization", f"Bearer {token}"), ("Content-Type", "application/json")]

    def send(method: str, path: str, body: object = None, sid: str | None = None) -> Answer:
        hs = auth + ([(SESSION_HEADER, sid)] if sid else [])
        data = None if body is None else json.dumps(body).encode()
        return exchange(("127.0.0.1", port), encode(method, path, hs, data))

    with Client(f"http://127.0.0.1:{port}", token=token) as p:
        p.put("w", np.ones(N, np.float32))
        p.put("keep", np.ones(N, np.float32))  # so the segment is not unlinked with w's bytes
        sid = send("POST", "/v1/sessions", {"pid": 1}).json()["session"]
        lease = send("GET", "/v1/tensors/w", sid=sid).json()["lease"]
        p.delete("w")  # the lease keeps its memory
        wait_for(lambda: p.stat().bytes_retired == MiB, 15, what="the session to lapse")
        answer = send("POST", "/v1/release", {"leases": [lease]}, sid=sid)
        assert answer.status == 200 and answer.json() == {"released": 1}, answer
        assert p.stat().bytes_retired == 0 and p.stat().bytes_in_use == MiB
        p.delete("keep")
