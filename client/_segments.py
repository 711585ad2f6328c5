"""The shared-memory segments a client has mapped: one open file per
segment (checked once: owner and mode, ``_trust.py``), and for writers one
whole-segment mapping, pre-faulted, that puts copy into.

Readers' views are lent from one kept private mapping per segment
(``shm._kept``), or map a window of their own where a range cannot be lent;
the fill and kept mappings live as long as the segment does.  ``prune``
forgets segments the broker unlinked, so their memory returns to the kernel
once no view uses them.
"""

from __future__ import annotations

import threading
from typing import Any

from .._errors import BrokerUnavailable
from ..shm import _kept
from ..shm._posix import SegmentFile, Window, byte_view
from ._extent import broken


class Segments:
    """Thread-safe; after ``fork()`` the child takes a fresh lock (``after_fork``)."""

    def __init__(self, trust: frozenset[int]) -> None:
        self._trust = trust
        self._files: dict[tuple[str, bool], SegmentFile] = {}
        self._fill_maps: dict[str, Window] = {}  # whole-segment writer mappings for put
        self._fill_flats: dict[str, Any] = {}  # the same, as flat uint8 arrays (put_many)
        self._kept: dict[str, _kept.KeptMap] = {}  # whole-segment reader mappings, lent per get
        self.keep = _kept.supported()
        self.lock = threading.Lock()

    def file(self, segment: str, writable: bool) -> SegmentFile:
        key = (segment, writable)
        f = self._files.get(key)
        if f is None:
            with self.lock:
                f = self._files.get(key)
                if f is None:
                    try:
                        f = self._files[key] = SegmentFile(
                            segment, writable=writable, trust=self._trust
                        )
                    except FileNotFoundError:
                        raise BrokerUnavailable(
                            f"segment {segment} is missing from /dev/shm: the broker restarted or "
                            f"runs in another IPC namespace (docker: share ipc with the broker)"
                        ) from None
                    except ValueError as exc:  # not a name a broker makes (shm check_name)
                        raise broken(f"segment {segment!r}", str(exc)) from None
                    except PermissionError:
                        raise BrokerUnavailable(
                            f"no permission to map segment {segment}: run as the broker's user or "
                            f"start it with --shm-group"
                        ) from None
        return f

    def reader(self, segment: str, offset: int, nbytes: int) -> Any:
        """What a reader's views of ``[offset, offset + nbytes)`` map: a range
        lent from the segment's kept mapping (``shm._kept``), or a fresh
        private window where it cannot be lent."""
        f = self.file(segment, False)
        k = self._kept.get(segment)
        if k is None and self.keep:
            if _kept.locked_now():  # a kept map would be copied whole, and go stale
                self.keep = False
            else:
                k = _kept.KeptMap(f)
                with self.lock:
                    k = self._kept.setdefault(segment, k)
        source = _kept.lend_or_map(k, f, offset, nbytes)
        if k is not None and k.retired:
            # This process locked its memory (mlock, mlockall): from now on
            # every get maps a window of its own (shm._kept, Locked memory).
            with self.lock:
                self.keep = False
                self._kept.clear()
        return source

    def fill_map(self, segment: str) -> Window:
        """The whole segment, mapped shared and writable once, for put's copies.
        Writers pre-fault it, a step at a time (``shm._posix._populate``)."""
        m = self._fill_maps.get(segment)
        if m is None:
            f = self.file(segment, True)
            m = f.window(0, f.size, writable=True, populate=True)
            with self.lock:
                m = self._fill_maps.setdefault(segment, m)
        return m

    def fill_flat(self, segment: str) -> Any:
        """The fill mapping of ``segment`` as one flat uint8 array (made once):
        slicing it is far cheaper than building an array per tensor."""
        a = self._fill_flats.get(segment)
        if a is None:
            m = self.fill_map(segment)
            a = byte_view(m, 0, m.size, writable=True)
            with self.lock:
                a = self._fill_flats.setdefault(segment, a)
        return a

    def prune(self) -> None:
        """Forget segments the broker unlinked, and settle kept mappings' returns."""
        for k in list(self._kept.values()):
            k.settle()
        with self.lock:
            for key, f in list(self._files.items()):
                if not f.exists():
                    del self._files[key]
                    self._fill_maps.pop(key[0], None)
                    self._fill_flats.pop(key[0], None)
                    self._kept.pop(key[0], None)

    def clear(self) -> None:
        with self.lock:
            self._files.clear()
            self._fill_maps.clear()
            self._fill_flats.clear()
            self._kept.clear()

    def after_fork(self) -> None:
        # The child maps its own: a kept map's lock may have been held by a
        # parent thread at fork.  Inherited views keep the parent's maps alive.
        self.lock = threading.Lock()
        self._kept = {}
