"""Ctrl-C in the middle of fork(): a SIGINT whose handler runs while the
Clients' fork hooks do.  A hook of this script's, registered next to theirs,
marks SIGINT due, so its KeyboardInterrupt lands in the first Python code
that checks for it: a fork hook (CPython reports the exception and drops
it), or the caller of fork() once it returns.

    python fork_interrupted.py BROKER_URL before|after

``before``: it is due as the Clients plan the fork.  ``after``: as the
parent comes out of it.  Two Clients with live views each.  The child uses
both Clients; then the parent drops its views, deletes their tensors and
puts others of the same size, which land in the freed memory if nothing
holds it; then the child checks that the views it inherited kept their
bytes.  Then the parent uses both Clients.

Prints ``interrupted`` if fork() itself raised, then ``ok``; ``hung`` (exit
4) when a Client is stuck.
"""

from __future__ import annotations

import _thread
import functools
import logging  # noqa: F401  (its own fork hooks come before this script's)
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

url, where = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt
# What a SIGINT does, and no more: it marks the handler due, to run at the
# next point where Python code checks (raise_signal and os.kill run it at once).
ctrl_c = _thread.interrupt_main
if where == "after":
    # Registered before the Clients' hooks: after a fork, this one runs first.
    os.register_at_fork(after_in_parent=ctrl_c)

from tensordepot import Client

if where == "before":
    # Registered after the Clients' hooks: before a fork, this one runs first.
    os.register_at_fork(before=ctrl_c)

N = (1 << 20) // 8  # float64 elements of a 1 MiB tensor (a pooled block)
A, B = np.arange(N, dtype=np.float64), np.arange(N, dtype=np.float64) * 2


def within(seconds: float, what: str, fn: functools.partial[Any]) -> None:
    """Run ``fn``; a Client stuck on a lock shows as "hung", not as a test timeout."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            failed.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(seconds):
        print(f"hung: {what}", flush=True)
        os._exit(4)
    if failed:
        raise failed[0]


def use(a: Client, b: Client, tag: str) -> None:
    for c, name in ((a, "fi.a"), (b, "fi.b")):
        c.put(f"{name}.{tag}", np.full(1000, 5.0))
        assert np.array_equal(np.from_dlpack(c.get(f"{name}.{tag}")), np.full(1000, 5.0))
        c.delete(f"{name}.{tag}")


def child(a: Client, b: Client, va: np.ndarray, vb: np.ndarray, go: int) -> int:
    assert np.array_equal(va, A) and np.array_equal(vb, B)
    within(20, "a Client in the child", functools.partial(use, a, b, "child"))
    print("child used", flush=True)
    if not select.select([go], [], [], 30)[0]:
        print("hung: the parent never said go", flush=True)
        return 4
    os.read(go, 1)
    if not (np.array_equal(va, A) and np.array_equal(vb, B)):
        print("CHANGED: a view the child inherited shows other bytes", flush=True)
        return 3
    del va, vb
    a.close()
    b.close()
    return 0


def main() -> None:
    a, b = Client(url), Client(url)
    a.put("fi.a", A)
    b.put("fi.b", B)
    va, vb = np.from_dlpack(a.get("fi.a")), np.from_dlpack(b.get("fi.b"))
    go_r, go_w = os.pipe()
    try:
        pid = os.fork()
    except KeyboardInterrupt:  # in the parent, once fork() returned: pid unknown
        print("interrupted", flush=True)
        pid = -1
    if pid == 0:
        code = 1
        try:
            code = child(a, b, va, vb, go_r)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    # The parent lets go of both tensors; the memory would be reused.  The
    # views' releases ride on the deletes.
    del va, vb
    a.delete("fi.a")
    b.delete("fi.b")
    ca, cb = np.full(N, 7.0), np.full(N, 9.0)
    a.put("fi.c", ca)
    b.put("fi.d", cb)
    held = np.from_dlpack(a.get("fi.c")), np.from_dlpack(b.get("fi.d"))
    os.write(go_w, b"x")
    deadline = time.monotonic() + 60
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)  # -1: the only child
        if got:
            break
        if time.monotonic() > deadline:
            print("hung: the child", flush=True)
            os._exit(4)
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child failed ({status})"
    within(20, "a Client in the parent", functools.partial(use, a, b, "parent"))
    assert np.array_equal(held[0], ca) and np.array_equal(held[1], cb)
    del held
    a.delete("fi.c")
    b.delete("fi.d")
    a.close()
    b.close()
    print("ok", flush=True)


main()
