"""Ctrl-C, over and over: a worker that gets, gets many, puts many, empties
and publishes in a loop while the test sends it SIGINT every few
milliseconds, catching every KeyboardInterrupt.  On ``stop`` (stdin), it
ignores SIGINT, drops every view it holds and prints what is left:
``left INTERRUPTS LIVE BROKER`` (the interrupts it caught, the leases its
client still counts as held by a view, the leases the broker holds for it)."""

from __future__ import annotations

import gc
import select
import signal
import sys
import time

import numpy as np
from tensordepot import Client

url = sys.argv[1]
names = [f"storm/s{i}" for i in range(8)]
armed = False  # the Ctrl-C raises only inside the loop's body: the library's calls, not the loop


def ctrl_c(signum: int, frame: object) -> None:
    """The handler the Client put in place, while armed: a Ctrl-C that it
    would raise is raised once per arming, so the except clause below never
    sees a second one; others are dropped."""
    global armed
    if armed:
        try:
            client_handler(signum, frame)
        except KeyboardInterrupt:
            armed = False
            raise


def filled(c: Client, step: int) -> object:
    """An ``empty()`` tensor, written and published.  Its name is a local:
    a Ctrl-C that cuts this leaves no view behind (a global would hold one
    until the next such step, past ``stop``)."""
    t = c.empty("storm/e", (1024,), "float32")
    np.from_dlpack(t)[:] = step
    t.publish()
    return t


with Client(url) as c:
    client_handler = signal.getsignal(signal.SIGINT)
    assert callable(client_handler)
    signal.signal(signal.SIGINT, ctrl_c)
    c.put_many({n: np.full(256, i, np.float32) for i, n in enumerate(names)})
    print("ready", flush=True)
    held: list[object] = []
    caught = step = 0
    stop = False
    while not stop:
        try:
            armed = True
            stop = bool(select.select([sys.stdin], [], [], 0)[0])
            step += 1
            op = step % 5
            if op == 0:
                held.append(c.get(names[step % 8]))
            elif op == 1:
                held.append(c.get_many(names))
            elif op == 2:
                c.put_many({n: np.full(256, step, np.float32) for n in names[:4]})
            elif op == 3:
                held.append(filled(c, step))
            else:
                c.put("storm/p", np.full(70_000, step, np.float32))  # not inline
            if len(held) > 16:
                held.clear()
            armed = False
        except KeyboardInterrupt:
            caught += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.readline()
    held.clear()
    gc.collect()
    bg = c._core.bg
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ((bg is not None and bg.live) or c.stat().leases > 0):
        time.sleep(0.05)
    live = 0 if bg is None else len(bg.live)
    print("left", caught, live, c.stat().leases, flush=True)
