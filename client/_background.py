"""The client's background thread: sends lease releases and request
cancellations, heartbeats heartbeat sessions, and forgets segments the
broker unlinked.

Finalizers (a view dying) only append to a deque and write one byte to a
pipe: they may run in any thread at any time, even inside this thread's own
code, so they must not take locks.  Nor may they call CUDA: a GPU lease's
release event is recorded here, by this thread, before its release is queued
(``release_after``).  A release rides on the client's next
request; only one that has waited ``_COALESCE`` seconds without one goes out
in a request of its own (with whatever else is queued by then), so a client
that keeps calling never pays a round trip for its releases.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import DepotError, UnknownSession
from .._proto import CANCEL_HEADER, RELEASE_HEADER
from .._wire import ReleaseRequest

log = logging.getLogger("tensordepot.client")
_COALESCE = 0.01  # seconds a queued release may wait for company (or a request to ride)
# While requests keep carrying the releases, the thread looks only this often
# (finalizers then need not wake it): a release queued just as the client goes
# quiet leaves within about this long.
_ACTIVE = 0.1
_CALM = 0.1  # seconds between rounds at the least, after a chore failed (see _run)

Key = tuple[str, int]  # (session id, lease id): ids restart with each broker


class Owner(Protocol):
    """What the thread works for (``_core.Core``)."""

    sid: str

    def call_now(self, method: str, path: str, body: Any = None, **kw: Any) -> Any: ...
    def rid(self) -> str: ...
    @property
    def forked(self) -> bool: ...
    def claim_if_forked(self) -> None: ...
    def reopen(self, stale: str) -> None: ...
    def prune(self) -> None: ...
    def _maybe_finish_close(self) -> None: ...


class Background:
    """One daemon thread per client."""

    def __init__(self, client: Owner) -> None:
        self.pending: collections.deque[Key] = collections.deque()
        # GPU leases whose views are gone: (what records the release event, session, lease).
        self.records: collections.deque[tuple[Callable[[], None], str, int]] = collections.deque()
        self.cancels: collections.deque[tuple[str, str]] = collections.deque()
        self.live: set[Key] = set()  # leases some view still holds
        # After fork: the parent's (session, lease) -> the child's copy of it.
        self.renamed: dict[Key, Key] = {}
        self.stale: dict[str, list[int]] = {}  # earlier session -> its leases no view holds
        # Releases queued again after a request that carried them was cut
        # (``give_back``): the broker may have released them, so they are
        # never taken back (``take_back``); forgotten once handed out again.
        self.doubtful: set[Key] = set()
        self._client = client
        self.heartbeat: float | None = None
        self._start()

    def _start(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._stop = False
        self._armed = False  # the thread knows something is queued: finalizers need not wake it
        self._since = 0.0  # when the queue last went from empty to not empty
        self.carried = 0  # releases requests have carried (the client is busy: see _run)
        self._carried_seen = 0
        self._busy_until = 0.0  # requests have been carrying releases: look again only then
        self._last_beat = self._last_prune = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="tensordepot-client", daemon=True)
        self.thread.start()

    def after_fork(self, renamed: dict[Key, Key]) -> None:
        """In a forked child: the parent's thread is gone and its pipe is the
        parent's.  Start our own, keep only the leases the child now holds."""
        for fd in (self._r, self._w):
            os.close(fd)
        self.pending.clear()
        self.doubtful.clear()
        self.cancels.clear()
        self.records.clear()  # the parent's GPU work: a forked child cannot use CUDA
        self.stale = {}
        self.renamed = renamed
        self.live = {renamed[k] for k in self.live if k in renamed}
        self._start()

    # -- what finalizers and calls queue -----------------------------------
    def track(self, sid: str, lease_id: int) -> None:
        self.live.add((sid, lease_id))

    def holding(self, sid: str) -> list[str]:
        """Sessions other than ``sid`` (those that lapsed under us) whose leases
        live views still hold: their memory must stay retired (README, Lifetime)."""
        return sorted({owner for owner, _ in list(self.live) if owner and owner != sid})[:64]

    def release_later(self, sid: str, lease_id: int) -> None:
        key = self.renamed.get((sid, lease_id), (sid, lease_id))
        self.live.discard(key)
        if not self.pending and not self.cancels:
            self._since = time.monotonic()
        self.pending.append(key)
        self._wake()

    def take_back(self, sid: str, lease_id: int) -> bool:
        """Take back a queued release never handed to a request, so the lease
        is held again (``_shmlane.again``, which asks only for leases of the
        current session); False if it is not queued (a view still holds the
        lease, or a request or ``flush`` took it), or if a request that
        carried it was cut before its answer (``give_back``: the broker may
        have released it).  Whoever sends releases takes them off
        ``pending`` one ``popleft`` at a time, and a ``remove`` is atomic as
        well: one of the two has it, never both."""
        key = (sid, lease_id)
        if key in self.doubtful:
            return False  # maybe released already
        try:
            self.pending.remove(key)
        except ValueError:
            return False
        return True

    def release_after(self, record: Callable[[], None], sid: str, lease_id: int) -> None:
        """A GPU lease's views are gone: this thread calls ``record`` (which
        records the release event on the streams that used them, and never
        raises), then queues the release.  From a finalizer: queue, wake."""
        self.records.append((record, sid, lease_id))
        try:
            os.write(self._w, b"x")  # always: the thread may be asleep for a second
        except OSError:
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _recorded(self) -> None:
        """Record the release events queued by finalizers, and queue their releases."""
        while self.records:
            try:
                record, sid, lease_id = self.records.popleft()
            except IndexError:
                break
            record()
            self.release_later(sid, lease_id)

    def cancel_later(self, sid: str, request_id: str) -> None:
        """A request whose answer was never read (Ctrl-C, a client-side timeout):
        the broker releases whatever it granted to it."""
        if not self.pending and not self.cancels:
            self._since = time.monotonic()
        self.cancels.append((sid, request_id))
        self._wake()

    def _wake(self) -> None:
        if not self._armed:
            self._armed = True
            try:
                os.write(self._w, b"x")
            except OSError:
                pass  # the pipe is full (a wake-up is pending anyway) or closed

    def take(self, limit: int = 4096) -> tuple[list[int], list[str]]:
        """Pending lease ids and request ids of the current session, for a
        request to carry (or for ``flush``).  Those of an earlier session ended
        with it (the broker restarted, or reaped it), and their ids may now
        name leases of the current session: they are dropped, never sent."""
        sid = self._client.sid
        ids: list[int] = []
        self.carried += 1
        doubtful = self.doubtful
        while self.pending and len(ids) < limit:
            try:
                owner, lease_id = key = self.pending.popleft()
            except IndexError:
                break
            if doubtful:
                doubtful.discard(key)
            if owner == sid:
                ids.append(lease_id)
            elif len(self.stale) < 64 or owner in self.stale:
                # A lease of a session that ended under us (it lapsed while this
                # process was paused): the broker retired its memory, and gives
                # it back once told no view of it is left.  Sent by ``flush``.
                self.stale.setdefault(owner, []).append(lease_id)
        rids: list[str] = []
        while self.cancels and len(rids) < limit:
            try:
                owner, rid = self.cancels.popleft()
            except IndexError:
                break
            if owner == sid:
                rids.append(rid)
        return ids, rids

    def riders(self, headers: dict[str, str]) -> tuple[list[int], list[str]]:
        """Put the queued releases and cancels on a request's ``headers``, so
        that they need no round trip of their own: what it carries."""
        if not (self.pending or self.cancels):
            return [], []
        ids, rids = self.take()
        if ids:
            headers[RELEASE_HEADER] = ",".join(map(str, ids))
        if rids:
            headers[CANCEL_HEADER] = ",".join(rids)
        return ids, rids

    def unanswered(self, sid: str, ids: list[int], rids: list[str], grant: str | None) -> None:
        """A request whose answer was never read: what rode on it goes out
        again, and what request ``grant`` was granted is cancelled."""
        self.give_back(ids, rids)
        if grant is not None:
            self.cancel_later(sid, grant)

    def give_back(self, ids: list[int], rids: list[str]) -> None:
        """A request that carried these failed before the broker answered: queue
        them again (releasing twice is harmless; ids are never reused)."""
        sid = self._client.sid
        keys = [(sid, i) for i in ids]
        self.doubtful.update(keys)  # first: never taken back once queued again
        self.pending.extend(keys)
        self.cancels.extend((sid, r) for r in rids)
        self._wake()

    def flush(self) -> None:
        self._recorded()
        ids, rids = self.take(1 << 20)
        self.carried -= 1  # not carried by a request: sent here
        stale, self.stale = self.stale, {}
        if ids or rids or stale:
            # Not validated here: the broker judges its limits (an error is logged below).
            body = ReleaseRequest.model_construct(leases=ids, requests=rids, stale=stale)
            try:
                # Releasing twice is harmless (ids are never reused): with a
                # request id, it is resent on a fresh connection if need be.
                self._client.call_now(
                    "POST", "/v1/release", body, background=True, rid=self._client.rid()
                )
            except DepotError as exc:  # the broker is gone: its leases are gone with it
                log.debug("release of %d lease(s) failed: %s", len(ids), exc)

    # -- the thread ------------------------------------------------------------
    def _run(self) -> None:
        client = self._client
        calm_until = 0.0  # after a chore failed: no faster than _CALM between rounds
        chores = (self._releases, self._beat, self._prune, client._maybe_finish_close)
        while not self._stop:
            wait = 1.0 if self.heartbeat is None else min(1.0, self.heartbeat)
            now = time.monotonic()
            if self.stale or client.forked:
                # Leases of a lapsed session, set aside by a request's take(); or
                # a forked child's session to claim: at once, for a child that
                # never claims in time lapses under its views (README, Lifetime).
                wait = 0.0
            elif self.pending or self.cancels:  # wake when the oldest is due
                due = self._since + _COALESCE
                wait = min(wait, max(0.0, max(due, self._busy_until) - now))
            elif self._busy_until > now:
                wait = min(wait, self._busy_until - now)
            wait = max(wait, calm_until - now)
            try:
                readable, _, _ = select.select([self._r], [], [], wait)
                if readable:
                    os.read(self._r, 4096)
            except OSError:
                break
            # Each chore on its own: one that fails in a way nobody foresaw is
            # logged and tried again next round, and never stops the others,
            # least of all the heartbeats that keep this process's views' memory
            # its own (a thread that died would let the session lapse under them).
            for chore in chores:
                try:
                    chore()
                except Exception:
                    calm_until = time.monotonic() + _CALM
                    log.exception(
                        "tensordepot client: the background thread's %s failed; it tries again",
                        getattr(chore, "__name__", chore),
                    )

    def _releases(self) -> None:
        """A forked child's claim first, then the releases nothing carried."""
        self._client.claim_if_forked()
        self._recorded()
        now = time.monotonic()
        if self.carried != self._carried_seen:  # the client is making requests: they carry releases
            self._carried_seen = self.carried
            self._busy_until = now + _ACTIVE
        # Disarmed first, then looked at: a release queued after this line
        # wakes us; one queued before it is seen below.
        self._armed = False
        busy = self._busy_until > now
        if self.stale or (
            (self.pending or self.cancels) and now - self._since >= _COALESCE and not busy
        ):
            self.flush()  # nothing carried them for _COALESCE seconds
        if self.pending or self.cancels or busy:
            self._armed = True  # we wake on our own in time: finalizers need not

    def _beat(self) -> None:
        """A heartbeat when one is due (heartbeat sessions only)."""
        now = time.monotonic()
        if self.heartbeat is None or now - self._last_beat < self.heartbeat:
            return
        self._last_beat = now
        client = self._client
        # Earlier sessions that lapsed while this process was paused,
        # whose leases views still hold: their memory must stay retired.
        sid = client.sid
        held = self.holding(sid)
        path = f"/v1/sessions/{sid}/heartbeat"
        if held:
            path += "?holding=" + ",".join(held)
        try:
            client.call_now("POST", path, background=True)
        except DepotError as exc:
            if isinstance(exc, UnknownSession):
                # It lapsed while this process was paused: open the next
                # one now, naming it while views still hold its leases.
                try:
                    client.reopen(sid)
                except DepotError:
                    pass

    def _prune(self) -> None:
        """Every two seconds: forget segments the broker unlinked."""
        now = time.monotonic()
        if now - self._last_prune >= 2.0:
            self._last_prune = now
            self._client.prune()

    def stop(self) -> None:
        self._stop = True
        try:
            os.write(self._w, b"x")
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
