"""Clients across ``fork()`` (README, Lifetime: M8), and at exit.

Every live Client registers here.  Just before a fork, each one that has
live views asks the broker for a session for the child holding copies of
its leases; in the child, each Client switches to that session (claimed on
its first call, or by its background thread), takes fresh locks, and never
touches its parent's connections or threads.  A Client therefore keeps
working in the child, and the views the child inherited stay valid there,
whatever the parent does next.

At a normal exit (``atexit``), each live Client ends its session on the way
out, so that the broker counts an exit, not a crash.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Protocol


class Forkable(Protocol):
    """What takes part in a fork (``_core.Core``)."""

    def _before_fork(self) -> None: ...
    def _after_fork_parent(self) -> None: ...
    def _after_fork_child(self) -> None: ...
    def _at_exit(self) -> None: ...


_clients: weakref.WeakSet[Forkable] = weakref.WeakSet()
_forking: list[Forkable] = []


def register(client: Forkable) -> None:
    _clients.add(client)


def _before() -> None:
    _forking[:] = list(_clients)
    for c in _forking:
        try:
            c._before_fork()
        except Exception:  # a fork must go ahead; the child copes without a plan
            pass


def _after_in_parent() -> None:
    for c in _forking:
        c._after_fork_parent()
    _forking.clear()


def _after_in_child() -> None:
    for c in _forking:
        c._after_fork_child()
    _forking.clear()


def _at_exit() -> None:
    for c in list(_clients):
        try:
            c._at_exit()
        except Exception:  # the process exits whatever the broker says
            pass


os.register_at_fork(before=_before, after_in_parent=_after_in_parent,
                    after_in_child=_after_in_child)
atexit.register(_at_exit)
