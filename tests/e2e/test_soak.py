"""Soak: worker processes put, get, delete and fill tensors on shared names
while the test SIGKILLs and respawns them, interrupts them (SIGINT, in the
middle of copies too), pauses them (SIGSTOP, past the session TTL for
the workers on TCP, whose sessions live on heartbeats), and hangs them
(SIGSTOP, then SIGKILL: readers that stopped heartbeating and died), sends
them Ctrl-C storms (SIGINT every 2 ms), and restarts the broker once, with
pickled SharedTensors in flight.  Workers put_many while others delete the
same names, fork with views alive (half of the children never claim their
session), put non-contiguous arrays, publish while a thread still writes,
and lock their memory (mlockall).  Every read is verified, and every view a
worker holds is re-verified after whatever happened to it
(tests/workers/lifetime_soak.py); at the end nothing may be left: no leases,
no bytes once the names are deleted, nothing in /dev/shm.

TENSORDEPOT_SOAK_SECONDS sets how long it runs (default 60);
TENSORDEPOT_SOAK_SEED replays a run's choices of who is killed when.
"""

from __future__ import annotations

import os
import random
import secrets
import select
import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest
from _harness import BrokerProc, free_port, wait_for
from _workerio import Worker, metrics

SOAK_S = float(os.environ.get("TENSORDEPOT_SOAK_SECONDS", "60"))
N_WORKERS = 8
KILL_EVERY = (0.1, 0.5)  # seconds between mishaps, uniformly drawn
SESSION_TTL = 1.0  # for the workers on TCP; a pause of PAUSE_S outlives it
PAUSE_S = 1.6
# A worker that hangs (SIGSTOP, never resumed) holding views is SIGKILLed after
# HANG_S: a reader that stopped heartbeating, then died.  Its memory must come back.
HANG_S = 3.0
# Memory a lapsed session could still map is retired, and comes back this
# long after the lapse (--lapse-grace): the bound on what the soak ends with.
LAPSE_GRACE = 4.0
STORM = 40  # SIGINTs in a Ctrl-C storm, 2 ms apart


def _counters(words: list[str]) -> Counter[str]:
    return Counter({k: int(v) for k, v in (w.split("=") for w in words)})


@pytest.mark.slow
def test_soak_kill_and_respawn(
    broker_factory: Callable[..., BrokerProc], capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("TENSORDEPOT_SOAK_SEED", str(time.time_ns() % 2**32)))
    rng = random.Random(seed)
    token = secrets.token_urlsafe(24)
    tcp = f"http://127.0.0.1:{free_port()}"
    b = broker_factory(
        "--listen",
        tcp,
        "--session-ttl",
        str(SESSION_TTL),
        "--lapse-grace",
        str(LAPSE_GRACE),
        env={"TENSORDEPOT_TOKEN": token},
    )
    t_start = time.monotonic()
    end = t_start + SOAK_S
    end_wall = time.time() + SOAK_S  # the workers stop themselves then

    # Workers with an odd seed use TCP (heartbeat sessions); the others the unix socket.
    zygote = Worker("lifetime_soak", b.url, repr(end_wall), tcp, env={"TENSORDEPOT_TOKEN": token})
    alive: set[int] = set()
    ready: set[int] = set()
    done: set[int] = set()
    killed: set[int] = set()
    paused: dict[int, float] = {}  # pid -> when to SIGCONT it
    hung: dict[int, float] = {}  # pid -> when to SIGKILL it
    mishaps: Counter[str] = Counter()
    last: dict[int, Counter[str]] = {}  # latest counters of each worker
    totals: Counter[str] = Counter()
    spawns = 0
    restart_at = t_start + SOAK_S * 0.4  # the broker restarts once, mid-soak
    restarts = 0

    def spawn() -> None:
        nonlocal spawns
        zygote.send(f"spawn {rng.getrandbits(32)}")
        spawns += 1

    def fail(msg: str) -> None:
        raise AssertionError(f"{msg} (soak seed {seed})\n{zygote.stderr()}")

    def handle(line: str) -> None:
        words = line.split()
        if words[0] == "spawned":
            alive.add(int(words[1]))
        elif words[0] == "exit":  # the zygote reaped a worker
            pid, status = int(words[1]), int(words[2])
            alive.discard(pid)
            totals.update(last.pop(pid, Counter()))
            expected = -9 if pid in killed else 0
            if status != expected or (pid not in killed and pid not in done):
                fail(f"soak worker {pid} ended with status {status}")
        elif words[1] == "ready":
            ready.add(int(words[0]))
        elif words[1] in ("n", "done"):
            last[int(words[0])] = _counters(words[2:])
            if words[1] == "done":
                done.add(int(words[0]))
        else:
            fail(f"soak worker says: {line}")

    def pump(timeout: float) -> None:
        assert zygote.proc.stdout is not None
        readable, _, _ = select.select([zygote.proc.stdout], [], [], max(timeout, 0))
        if readable:
            lines = zygote.read_lines()
            if lines is None:
                fail(f"the soak zygote exited ({zygote.wait()})")
            for line in lines or ():
                handle(line)

    try:
        zygote.expect("zygote ready")
        for _ in range(N_WORKERS):
            spawn()
        next_kill = time.monotonic() + rng.uniform(*KILL_EVERY)
        while time.monotonic() < end:
            wake = min([next_kill, end, *paused.values(), *hung.values()])
            pump(wake - time.monotonic())
            now = time.monotonic()
            for pid in [p for p, t in paused.items() if t <= now or now >= end - PAUSE_S]:
                os.kill(pid, signal.SIGCONT)
                del paused[pid]
            for pid in [p for p, t in hung.items() if t <= now or now >= end - PAUSE_S]:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                del hung[pid]
                spawn()
            if not restarts and now >= restart_at:
                # Every worker's calls fail until it is back; views and pickles
                # from before must never meet the new run's tensors.
                assert b.stop() == 0, b.log()
                b.start()
                restarts += 1
            if now >= next_kill and now < end - PAUSE_S - 0.5:
                candidates = sorted((alive & ready) - done - killed - set(paused) - set(hung))
                if candidates:
                    pid = rng.choice(candidates)
                    what = rng.choices(
                        ["kill", "interrupt", "pause", "hang", "storm"], [2, 2, 1, 0.5, 0.5]
                    )[0]
                    if what == "kill":
                        os.kill(pid, signal.SIGKILL)
                        killed.add(pid)
                        spawn()
                    elif what == "interrupt":
                        os.kill(pid, signal.SIGINT)
                    elif what == "storm":
                        for _ in range(STORM):
                            os.kill(pid, signal.SIGINT)
                            time.sleep(0.002)  # the storm's pace, not a wait for a condition
                    elif what == "pause":
                        os.kill(pid, signal.SIGSTOP)
                        paused[pid] = now + PAUSE_S
                    else:
                        os.kill(pid, signal.SIGSTOP)
                        hung[pid] = now + HANG_S
                    mishaps[what] += 1
                next_kill = now + rng.uniform(*KILL_EVERY)
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        paused.clear()
        for pid in hung:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        hung.clear()
        # The workers stop at the deadline by themselves, report, and are reaped.
        wind_down = time.monotonic() + 60
        while alive or len(done) + len(killed) < spawns:
            if time.monotonic() > wind_down:
                fail(f"workers {sorted(alive)} did not finish")
            pump(wind_down - time.monotonic())
        zygote.proc.stdin.close()  # type: ignore[union-attr]
        assert zygote.wait() == 0, zygote.stderr()
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        for pid in hung:
            os.kill(pid, signal.SIGKILL)
        zygote.close()
    kills = len(killed)

    with b.client() as c:
        # The last workers killed are reclaimed within seconds; the rest closed cleanly.
        seen: list[object] = []

        def drained() -> bool:
            st = c.stat()
            seen[:] = [st, [i for i in c.list() if i.readers]]
            return st.leases == 0 and st.sessions == 1

        try:
            # A fork interrupted between its request and fork() leaves a session that
            # nobody claims: it ends after the claim window (10 s) and a heartbeat TTL.
            wait_for(drained, 20, what="every session and lease of the soak to end")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}\n{b.log()[-3000:]}") from None
        remaining = [i.name for i in c.list()]
        for name in remaining:
            c.delete(name)
        # Retired memory of the last sessions to lapse comes back after the grace.
        wait_for(
            lambda: c.stat().bytes_retired == 0,
            LAPSE_GRACE + 10,
            what=f"retired memory to come back within --lapse-grace ({LAPSE_GRACE:g} s)",
        )
        st = c.stat()
    assert (st.leases, st.bytes_in_use, st.versions, st.tensors) == (0, 0, 0, 0), st
    broker_counts = metrics(b.url)
    assert b.stop() == 0, b.log()
    b.expect_dead = True  # type: ignore[attr-defined]
    left = b.segments()
    assert left == [], f"/dev/shm still holds {left}"

    assert kills >= SOAK_S / 2, f"only {kills} kills in {SOAK_S:g} s"
    assert mishaps["interrupt"] >= SOAK_S / 2 and mishaps["pause"] >= SOAK_S / 6, mishaps
    assert mishaps["hang"] >= SOAK_S / 20, mishaps
    assert totals["batches"] >= SOAK_S and totals["unclaimed_forks"] >= 1, totals
    assert totals["reads"] >= 10 * SOAK_S, totals
    assert restarts == 1 and mishaps["storm"] >= 1, (restarts, mishaps)
    assert totals["race_publishes"] >= 1 and totals["race_reads"] >= 1, totals
    assert totals["pickles_read"] + totals["pickles_refused"] >= 1, totals
    assert totals["batch_views_kept"] >= 1, totals  # a pack's lease held across the mishaps
    assert totals["prefix_deletes"] >= 1, totals
    reaped = int(broker_counts.get("tensordepot_sessions_ended_total", 0))
    with capsys.disabled():
        print(
            f"\nsoak (seed {seed}): {time.monotonic() - t_start:.0f} s, {N_WORKERS} workers, "
            f"{kills} SIGKILLs, {mishaps['interrupt']} SIGINTs and {mishaps['storm']} storms of "
            f"{STORM} ({totals['interrupted']} cut an operation short), {restarts} broker "
            f"restart ({totals['unavailable']} calls failed meanwhile), "
            f"{mishaps['pause']} SIGSTOPs of {PAUSE_S:g} s "
            f"(TTL {SESSION_TTL:g} s on TCP), {mishaps['hang']} hangs of {HANG_S:g} s then SIGKILL "
            f"survived; {totals['ops']} operations: "
            f"{totals['reads']} verified reads "
            f"+ {totals['rechecks']} re-checks of held views, {totals['puts']} puts "
            f"({totals['strided']} non-contiguous), {totals['batches']} put_many of 3 names, "
            f"{totals['batch_views_kept']} views of get_many tensors kept (their packs' leases), "
            f"{totals['forks']} forks with views alive "
            f"(and {totals['unclaimed_forks']} whose child never claimed its session), "
            f"{totals['publishes']} empty+publish, {totals['abandoned']} abandoned writes, "
            f"{totals['race_publishes']} publishes racing a writer thread and "
            f"{totals['race_reads']} reads of them checked unchanged, "
            f"{totals['mlocked']} workers under mlockall ({totals['mlock_refused']} refused), "
            f"{totals['pickles_read']} pickles read back and {totals['pickles_refused']} refused "
            f"(gone, replaced, or from the broker's earlier run), "
            f"{totals['deletes']} deletes and {totals['prefix_deletes']} by prefix, "
            f"{totals['misses']} not-found, "
            f"{totals['reconnects']} reconnects; broker: {reaped} sessions ended, "
            f"{int(broker_counts.get('tensordepot_writes_reclaimed_total', 0))} writes reclaimed, "
            f"{int(broker_counts.get('tensordepot_expired_total', 0))} ttl expiries, "
            f"{int(broker_counts.get('tensordepot_sessions_lapsed_total', 0))} sessions lapsed, "
            f"{st.retired_total} bytes retired, "
            f"{len(remaining)} names deleted at the end; then 0 leases, 0 bytes in use, "
            "/dev/shm clean"
        )
