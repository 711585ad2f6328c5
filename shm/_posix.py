"""POSIX shared-memory segments under /dev/shm, and per-process mappings.

The broker creates segments (``PosixSegment.create``) and is the only one to
unlink them.  Clients and the broker map them with ``PosixMapping``, which
calls mmap(2) directly through libc instead of using ``mmap.mmap`` or
``multiprocessing.shared_memory``:

* the raw address is needed for DLPack, and ``mmap.mmap`` refuses to close
  while a buffer export exists, which a long-lived tensor view always is;
* before Python 3.13 ``multiprocessing.shared_memory`` registers segments with
  the resource tracker, which unlinks them when *any* attaching process exits
  (gh-82300), destroying memory that the broker still owns.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import stat
import weakref
from collections.abc import Collection
from typing import Any

from .._errors import UntrustedBroker
from .._ids import describe_uid

SHM_DIR = "/dev/shm"
KIND = "posix"
# shm_open(3) names are a single path component below /dev/shm; NAME_MAX is
# 255 on Linux.  Our names are a prefix plus 32 hex digits (128 random bits).
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

_PROT_READ = 0x1
_PROT_WRITE = 0x2
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
# mmap offsets must be multiples of the page size (mmap(2)); a window over
# [offset, offset + n) maps the whole pages around it.
PAGE = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14
# Pre-faulting holds the process's mmap lock: in one call (MAP_POPULATE) a
# 1 GiB segment holds it for about half a second, and every other thread
# that maps, unmaps or grows its heap meanwhile (an event loop answering
# requests) waits that long.  In steps of this size, it waits one step.
_POPULATE_STEP = 16 << 20


def check_name(name: str) -> str:
    """Return ``name`` if it is a safe single-component shm name, else raise ValueError."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return name


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, check_name(name))


def random_name(prefix: str) -> str:
    """An unguessable segment name: ``prefix`` plus 128 random bits."""
    return check_name(prefix + secrets.token_hex(16))


class PosixSegment:
    """A segment the broker owns.  Created O_EXCL; ``unlink()`` removes the
    name (mappings stay valid until each process unmaps them)."""

    kind = KIND
    name: str = ""
    size: int = 0
    _unlinked = True

    def __init__(
        self,
        name: str,
        size: int,
        *,
        mode: int = 0o600,
        gid: int | None = None,
        prefault: bool = True,
    ) -> None:
        path = segment_path(name)
        # O_EXCL: a name collision (or an attacker pre-creating the name) is an
        # error, never a silent attach to someone else's memory.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        self.name, self.size, self._unlinked = name, size, False
        try:
            os.fchmod(fd, mode)  # the umask may have changed the mode we asked for
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, size)
            if prefault and size:
                # Allocate the tmpfs pages now: a copy into fresh pages runs ~14x
                # slower than into allocated ones, so puts must never pay this.
                os.posix_fallocate(fd, 0, size)
        except OSError:
            self.unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name from /dev/shm.  Idempotent; only the broker calls it."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"PosixSegment({self.name!r}, size={self.size})"


def check_segment(fd: int, name: str, trust: Collection[int] | None = None) -> None:
    """Refuse to map a segment a trusted broker would not have made.

    The owner must be a trusted uid (``trust``; by default this process's
    uid and root), and nobody outside the owner and its group may write it:
    never world-writable, and group-writable only for a group this process is
    in (the broker's --allow-gid group) or when the segment is our own.  A
    segment that fails is someone else's memory: writing our tensor into it
    would hand them the bytes, and reading from it would let them change what
    we read.  Raises UntrustedBroker.
    """
    st = os.fstat(fd)
    me = os.geteuid()
    trusted = {me, 0} if trust is None else trust
    mode = stat.S_IMODE(st.st_mode)
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif st.st_uid not in trusted:
        problem = f"it belongs to uid {describe_uid(st.st_uid)}, a user this process does not trust"
    elif mode & 0o002:
        problem = f"its mode {mode:04o} lets every user write it"
    elif mode & 0o020 and st.st_uid != me and st.st_gid not in (os.getegid(), *os.getgroups()):
        problem = f"its mode {mode:04o} lets group {st.st_gid} (this process is not in it) write it"
    if problem:
        raise UntrustedBroker(
            f"refusing to map segment {name}: {problem}. The broker that handed it out may be an "
            f"impostor (check who serves its socket); if a user you trust runs your broker, pass "
            f"Client(trust_uid=...) or set $TENSORDEPOT_TRUST_UID"
        )


def open_segment(name: str, flags: int, trust: Collection[int] | None = None) -> int:
    """Open a segment to map it; the caller owns the fd.  Refuses a symlink
    (O_NOFOLLOW) and anything ``check_segment`` refuses, with UntrustedBroker."""
    try:
        fd = os.open(segment_path(name), flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UntrustedBroker(
            f"refusing to map segment {name}: it is a symbolic link, which a broker never creates"
        ) from None
    try:
        check_segment(fd, name, trust)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _munmap(address: int, size: int) -> None:
    _libc.munmap(address, size)


def _populate(address: int, size: int) -> None:
    """Fault in ``[address, address + size)`` for writing, a step at a time
    (see ``_POPULATE_STEP``).  On kernels without MADV_POPULATE_WRITE, or
    where it fails, the pages fault in as they are first written."""
    for at in range(0, size, _POPULATE_STEP):
        if _libc.madvise(address + at, min(_POPULATE_STEP, size - at), _MADV_POPULATE_WRITE):
            return


def _mmap(
    address: int | None, size: int, prot: int, flags: int, fd: int, offset: int, name: str
) -> int:
    addr = _libc.mmap(address, size, prot, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {name!r} failed: {os.strerror(err)}")
    return int(addr)


class SegmentFile:
    """An open segment, from which this process maps windows.

    Opening costs a path lookup; mapping a window of an open file costs one
    mmap(2), so clients keep one ``SegmentFile`` per segment and map a window
    per tensor.  The fd is closed when the object is garbage collected, which
    happens after every window made from it is gone (windows hold it)."""

    _fd = -1

    def __init__(self, name: str, *, writable: bool, trust: Collection[int] | None = None) -> None:
        self.name = name
        self.writable = writable
        # Only a segment a trusted broker made (see check_segment).
        fd = open_segment(name, os.O_RDWR if writable else os.O_RDONLY, trust)
        try:
            self.size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def fd(self) -> int:
        return self._fd

    def window(self, offset: int, nbytes: int, *, writable: bool, populate: bool = False) -> Window:
        return Window(self, offset, nbytes, writable=writable, populate=populate)

    def exists(self) -> bool:
        """Whether the segment still has its name (the broker has not unlinked it)."""
        return os.path.exists(segment_path(self.name))


class Window:
    """One mapping of ``[offset, offset + nbytes)`` of a segment.

    * A *reader* window is ``MAP_PRIVATE`` and writable: published bytes are
      read in place (the page cache's own pages, no copy), and a stray write
      through a consumer that ignores read-only flags (torch, jax) lands on a
      private copy of that page in this process only.  It never reaches the
      segment, and it never faults.
    * A *writer* window is ``MAP_SHARED``: writes go to the segment.  After
      publish, ``make_private`` replaces it in place with a ``MAP_PRIVATE``
      mapping of the same pages (``MAP_FIXED``, so every view's pointer stays
      valid): from then on a write through the writer's old views stays in the
      writer and can never change what readers see.

    The window is unmapped when this object is garbage collected, after every
    view that references it (numpy arrays, DLPack capsules, torch tensors)."""

    kind = KIND
    address: int = 0
    _base = 0  # 0 until mapped: nothing to unmap

    def __init__(
        self, file: SegmentFile, offset: int, nbytes: int, *, writable: bool, populate: bool = False
    ) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > file.size:
            raise ValueError(
                f"window [{offset}, {offset + nbytes}) is outside segment "
                f"{file.name!r} of {file.size} bytes"
            )
        self.file, self.name, self.writable = file, file.name, writable
        start = offset - offset % PAGE
        self._len = max(-(-(offset + nbytes) // PAGE) * PAGE - start, PAGE)
        self._start = start
        flags = _MAP_SHARED if writable else _MAP_PRIVATE
        self._base = _mmap(
            None, self._len, _PROT_READ | _PROT_WRITE, flags, file._fd, start, file.name
        )
        if populate and writable:
            _populate(self._base, self._len)
        self.address = self._base + offset - start
        self.size = nbytes

    def __del__(self) -> None:
        # Not weakref.finalize: a reader maps a window per get, and registering
        # a finalizer costs as much as the mmap.  Runs once every view is gone.
        if self._base:
            try:
                _munmap(self._base, self._len)
            except Exception:  # at interpreter exit, libc may be gone
                pass

    @property
    def shared(self) -> bool:
        return self.writable

    def make_private(self) -> None:
        """Turn a writer window into a private one, in place (see the class docstring)."""
        if not self.writable:
            return
        _mmap(
            self._base,
            self._len,
            _PROT_READ | _PROT_WRITE,
            _MAP_PRIVATE | _MAP_FIXED,
            self.file.fd,
            self._start,
            self.name,
        )
        self.writable = False

    def __repr__(self) -> str:
        mode = "shared" if self.writable else "private"
        return f"Window({self.name!r}, {mode}, size={self.size}, at=0x{self.address:x})"


class PosixMapping:
    """This process's mapping of a segment.

    The mapping is unmapped when this object is garbage collected, which
    happens only after every view that references it (numpy arrays, DLPack
    capsules, torch tensors) is gone.  Readers map with PROT_READ, so a write
    through a view that ignores read-only flags faults instead of changing
    bytes that other processes read.
    """

    kind = KIND
    address: int = 0
    size: int = 0

    def __init__(
        self,
        name: str,
        *,
        writable: bool,
        populate: bool = False,
        trust: Collection[int] | None = None,
    ) -> None:
        self.name = name
        self.writable = writable
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = open_segment(name, flags, trust)  # refuses memory that a trusted broker did not make
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"segment {name!r} is empty")
            prot = _PROT_READ | (_PROT_WRITE if writable else 0)
            addr = _mmap(None, size, prot, _MAP_SHARED, fd, 0, name)
            if populate and writable:
                _populate(addr, size)
        finally:
            # The mapping keeps the memory alive; the fd is not needed after mmap.
            os.close(fd)
        self.address, self.size = addr, size
        self._finalizer = weakref.finalize(self, _munmap, addr, size)

    def exists(self) -> bool:
        """Whether the segment still has its name (the broker has not unlinked it)."""
        return os.path.exists(segment_path(self.name))

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "r"
        return f"PosixMapping({self.name!r}, {mode}, size={self.size}, at=0x{self.address:x})"


def sweep(prefix: str, keep: set[str] | None = None) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (except ``keep``).

    A broker calls this on start, holding the prefix lock, to remove what a
    dead broker left behind.  What it cannot unlink (a directory that shares
    the prefix, another user's file) is no segment of ours: it stays.
    """
    removed: list[str] = []
    keep = keep or set()
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.startswith(prefix) and entry not in keep:
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    return removed


class PrefixLockError(RuntimeError):
    """The prefix lock cannot be taken: another live broker holds it, or the
    file at its path is not one this broker may trust (one line, for the CLI)."""


class PrefixLock:
    """An exclusive flock on ``/dev/shm/<prefix>lock``.

    Held for the broker's whole life.  The kernel drops it when the broker
    dies, so the next broker can tell a dead owner (lock free: sweep its
    segments) from a live one (lock held: refuse to start).

    The path is predictable and /dev/shm is writable by every local user, so
    the file is opened without following a symlink, and it must be a regular
    file of this process's uid that neither group nor others may write:
    anything else was planted, and the broker refuses to start
    (``PrefixLockError``) rather than lock, or create, a file it does not own.
    """

    _fd = -1

    def __init__(self, prefix: str, mode: int = 0o600) -> None:
        self.name = check_name(prefix + "lock")
        path = segment_path(self.name)
        fix = "remove it (another local user may have planted it), or give another --shm-prefix"
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags, mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PrefixLockError(f"the lock file {path} is a symbolic link; {fix}") from None
            if exc.errno == errno.EACCES:
                raise PrefixLockError(
                    f"cannot open the lock file {path} ({exc.strerror}): {_owner(path)}; {fix}"
                ) from None
            raise
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            os.close(fd)
            raise PrefixLockError(
                f"the lock file {path} is not this broker's (uid {os.geteuid()}, not writable by "
                f"others): {_owner(path)}; {fix}"
            )
        self._fd = fd
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            self._fd = -1
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise PrefixLockError(
                    f"another live broker holds the segment prefix {prefix!r} ({path}); stop it, "
                    f"or give this one another --listen path or --shm-prefix"
                ) from None
            raise

    def release(self) -> None:
        """Unlink the lock file and drop the lock.  Idempotent."""
        if self._fd < 0:
            return
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def _owner(path: str) -> str:
    """Who owns ``path`` and its mode, for a message."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or "it cannot be read"
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
    return f"it is {kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def byte_view(mapping: Any, offset: int, nbytes: int, *, writable: bool) -> Any:
    """A flat uint8 numpy array over ``mapping`` at ``offset``; it keeps ``mapping`` alive."""
    return array_at(
        mapping.address + offset, (nbytes,), None, "|u1", writable=writable, owner=mapping
    )


class _ArrayInterface:
    """Holds ``owner`` alive for as long as numpy arrays built from it live."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, iface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = iface
        self.owner = owner


def array_at(
    address: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    typestr: Any,
    *,
    writable: bool,
    owner: Any,
) -> Any:
    """A numpy array over raw memory; ``strides`` in bytes (None: C order)."""
    import numpy as np

    dt = np.dtype(typestr)
    # User-defined types (ml_dtypes' bfloat16, float8_*) have no typestr that
    # numpy parses back (float8_e5m2 says '<f1'): describe their bytes as raw
    # void of the same size, then view them as the type below.
    raw = np.dtype(f"V{dt.itemsize}") if dt.isbuiltin == 2 else dt
    iface = {
        "version": 3,
        "shape": tuple(shape),
        "typestr": raw.str,
        "descr": raw.descr,
        "data": (address, not writable),
        "strides": tuple(strides) if strides is not None else None,
    }
    arr = np.asarray(_ArrayInterface(iface, owner))
    if arr.dtype != dt:
        arr = arr.view(dt)
    return arr
