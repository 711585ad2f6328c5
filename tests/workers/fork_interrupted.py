"""Ctrl-C in the middle of fork(): a SIGINT whose handler runs while the
Clients' fork hooks do.  A hook of this script's, registered next to theirs,
marks SIGINT due, so its KeyboardInterrupt lands in the first Python code
that runs after it: one of the Clients' fork hooks (CPython reports the
exception and drops it), or the caller of fork() once it returns.

    python fork_interrupted.py BROKER_URL before|after

``before``: it lands as the Clients plan the fork.  ``after``: as the parent
comes out of it.  Two Clients with live views each; the child checks the
views it inherited and uses both Clients, then the parent does.  Prints
``interrupted`` if fork() itself raised, then ``ok``; ``hung`` (exit 4)
when a Client is stuck.
"""

from __future__ import annotations

import _thread
import functools
import logging  # noqa: F401  (its own fork hooks come before this script's)
import os
import signal
import sys
import threading
import time
import traceback

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


def within(seconds: float, what: str, fn: functools.partial[object]) -> None:
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


def main() -> None:
    a, b = Client(url), Client(url)
    a.put("fi.a", np.arange(1000.0))
    b.put("fi.b", np.arange(2000.0))
    va, vb = np.from_dlpack(a.get("fi.a")), np.from_dlpack(b.get("fi.b"))
    try:
        pid = os.fork()
    except KeyboardInterrupt:  # in the parent, once fork() returned: pid unknown
        print("interrupted", flush=True)
        pid = -1
    if pid == 0:
        code = 1
        try:
            assert np.array_equal(va, np.arange(1000.0)) and np.array_equal(vb, np.arange(2000.0))
            within(20, "a Client in the child", functools.partial(use, a, b, "child"))
            a.close()
            b.close()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 30
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
    assert np.array_equal(va, np.arange(1000.0)) and np.array_equal(vb, np.arange(2000.0))
    del va, vb
    a.delete("fi.a")
    b.delete("fi.b")
    a.close()
    b.close()
    print("ok", flush=True)


main()
