"""Clients across ``fork()`` (README, Lifetime: M8), and at exit.

Every live Client registers here.  Just before a fork, each one that has
live views asks the broker for a session for the child holding copies of
its leases; in the child, each Client switches to that session (claimed on
its first call, or by its background thread), takes fresh locks, and never
touches its parent's connections or threads.  A Client therefore keeps
working in the child, and the views the child inherited stay valid there,
whatever the parent does next.

``GATE`` is held from just before those requests until the fork is done, so
no lease is registered in between (it would be missing from the child's
copies).  A signal handler may raise anywhere in Python code (Ctrl-C in the
middle of a fork: its KeyboardInterrupt lands in whichever fork hook is
running, and CPython reports and drops it).  So what must happen on every
fork happens in C, where no handler can run: the gate is taken and let go,
and the plans of the last fork are forgotten, by C callables registered as
fork hooks of their own, and the handlers already due run in one just before
the plans are made.  The Python hooks only make plans and set up the child's
Clients; an interruption in one Client's part still lets the others take
theirs.

At a normal exit, each live Client ends its session on the way out (with
views alive: once the process is gone), so that the broker counts an exit,
not a crash.  A normal exit is ``atexit``, and the end of a
``multiprocessing`` child (a DataLoader worker, a forked Process), which
leaves with ``os._exit`` after its own finalizers, never running ``atexit``.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import signal
import sys
import threading
import weakref
from typing import Any, Protocol


class Forkable(Protocol):
    """What takes part in a fork (``_core.Core``)."""

    def _plan_fork(self) -> Any: ...
    def _after_fork_child(self, plan: Any) -> None: ...
    def _at_exit(self) -> None: ...


# Reentrant, so that letting it go after a fork whose hook could not take it
# (a wait for it cut short by a signal handler) raises instead of releasing
# another thread's hold.
GATE = threading.RLock()

_clients: weakref.WeakSet[Forkable] = weakref.WeakSet()
# id(client) -> (client, its plan), for the fork under way: emptied by C hooks
# before every fork and after it, in both processes.
_plans: dict[int, tuple[Forkable, Any]] = {}


def register(client: Forkable) -> None:
    _clients.add(client)
    _arm()


class _Token:
    """What multiprocessing's after-fork registry keeps a weak reference to."""


_TOKEN = _Token()
_armed = False
_exited = False


def _arm() -> None:
    """Once ``multiprocessing`` is in use: have each process it starts run
    ``_at_exit`` among its finalizers (registered in the child, after the
    finalizers it inherited are cleared)."""
    global _armed
    util = sys.modules.get("multiprocessing.util")
    if _armed or util is None:
        return
    _armed = True
    util.register_after_fork(_TOKEN, _in_child)


def _in_child(_: object) -> None:
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


def gate_is_free() -> bool:
    """Whether taking the gate now would not wait (no fork under way, no
    lease being registered by another thread)."""
    if not GATE.acquire(blocking=False):
        return False
    GATE.release()
    return True


def _each(clients: list[Forkable], part: Any) -> None:
    """``part(client)`` for each client, even when one of them is cut short
    (a signal handler raising, or an error): the first exception is raised
    at the end, for CPython to report."""
    cut: BaseException | None = None
    for c in clients:
        try:
            part(c)
        except BaseException as exc:
            cut = cut or exc
    if cut is not None:
        raise cut


def _plan(c: Forkable) -> None:
    _plans[id(c)] = (c, None)  # the strong reference keeps c until the fork is done
    cut: BaseException | None = None
    for _ in range(2):  # once more when a signal handler cut the request short
        try:
            _plans[id(c)] = (c, c._plan_fork())
            break
        except Exception:  # a fork must go ahead; the child copes without a plan
            break
        except BaseException as exc:
            cut = cut or exc
    if cut is not None:
        raise cut


def _before() -> None:
    _each(list(_clients), _plan)


def _after_in_child() -> None:
    global _exited
    _exited = False
    _arm()
    # Every client, planned or not: a hook cut short before it planned them
    # must not leave a child using its parent's connections and threads.
    plans = dict(_plans)
    _each(list(_clients), lambda c: c._after_fork_child(plans.get(id(c), (c, None))[1]))


def _at_exit() -> None:
    global _exited
    if _exited:  # a multiprocessing child that exits with sys.exit runs both
        return
    _exited = True
    for c in list(_clients):
        try:
            c._at_exit()
        except Exception:  # the process exits whatever the broker says
            pass


os.register_at_fork(before=_before, after_in_child=_after_in_child)
# Registered after the hooks above: before a fork, hooks run last-registered
# first, so these run ahead of ``_before``; after it, in the order registered,
# so they run once ``_after_in_child`` is done.  Each is a C callable.
#
# Right before ``_before``: run the signal handlers already due (a Ctrl-C
# that came in just before the fork), here rather than as ``_before`` starts,
# where their exception would cut every plan short.  pthread_sigmask, with
# nothing to block, does only that: the C one (signal's own is a Python wrapper).
_sigmask = importlib.import_module("_signal").pthread_sigmask
os.register_at_fork(before=functools.partial(_sigmask, signal.SIG_BLOCK, ()))
os.register_at_fork(before=_plans.clear, after_in_parent=_plans.clear, after_in_child=_plans.clear)
os.register_at_fork(before=GATE.acquire, after_in_parent=GATE.release, after_in_child=GATE.release)
atexit.register(_at_exit)
_arm()
