"""Sessions bound to their process, and retired memory that comes back, tried
against a real broker with real worker processes.

A session id used by another process of the same user is refused (403), and
the owner's views keep their bytes; memory retired because the broker could
not vouch for a holder comes back once the holder is proven gone, or after a
bounded grace (a lapsed heartbeat session, an unclaimed fork, an empty()
past --alloc-ttl); a process that exits normally is not counted as a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _harness import WORKERS, BrokerProc, wait_for
from _workerio import Worker
from tensordepot import Client, Stat

MiB = 1 << 20
N = MiB // 4  # float32 elements of a 1 MiB tensor (a pooled block)


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    """Driven workers (``_workerio``), killed, even when stopped, at the end."""
    started: list[Worker] = []
    yield lambda script, *args, **kw: started.append(Worker(script, *args, **kw)) or started[-1]
    for w in started:
        w.close()


def stat_when(c: Client, pred: Callable[[Stat], bool], what: str, timeout: float = 10) -> Stat:
    def check() -> Stat | None:
        st = c.stat()
        return st if pred(st) else None

    return wait_for(check, timeout, what=what)  # type: ignore[no-any-return]


def drained(c: Client) -> Stat:
    """Nothing left but the probe's own session: no lease, no byte, nothing retired."""
    return stat_when(c, lambda s: (s.sessions, s.leases, s.bytes_in_use, s.bytes_retired)
                     == (1, 0, 0, 0), "the broker to drain")


# -- 1. a session id works only from the process that opened it ------------------------------


STOLEN = ("heartbeat", "release", "piggyback", "put", "fork", "get", "close")


def steal(b: BrokerProc, sid: str, lease: int | None) -> dict[str, list[object]]:
    """What another process of this user got, using session ``sid``."""
    argv = [sys.executable, str(WORKERS / "session_thief.py"), b.sock, sid, str(lease)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_session_id_used_by_another_process_of_the_same_user_is_403(
        broker: BrokerProc) -> None:
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
        drained(owner)

