"""Clients across ``fork()`` (README, Lifetime: M8).

Every live Client registers here.  Just before a fork, each one that has
live views asks the broker for a session for the child holding copies of
its leases; in the child, each Client switches to that session (claimed on
its first call, or by its background thread), takes fresh locks, and never
touches its parent's connections or threads.  A Client therefore keeps
working in the child, and the views the child inherited stay valid there,
whatever the parent does next.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Forkable(Protocol):
    """What takes part in a fork (``_core.Core``)."""

    def _before_fork(self) -> None: ...
    def _after_fork_parent(self) -> None: ...
    def _after_fork_child(self) -> None: ...


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


os.register_at_fork(before=_before, after_in_parent=_after_in_parent,
                    after_in_child=_after_in_child)
