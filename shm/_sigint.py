"""Ctrl-C lands where the client waits, never inside its bookkeeping.

A SIGINT raises ``KeyboardInterrupt`` at the next point where the
interpreter checks for signals, and that can be anywhere: the first
instruction of a finalizer (``_Lease.__del__``, whose release is then lost
and its lease held until the session ends), the middle of an ``except``
clause that gives back what a request was granted, a generator resumed by
the driver.  Under a storm of them (a user holding Ctrl-C), such cuts leak
leases and leave operations half done.

So a client installs, once and only over Python's own default handler
(a handler of the application's is left alone), a SIGINT handler that looks
at where the signal landed.  Walking out from the interrupted frame, the
first frame that decides is either

* a wait marked ``interruptible`` (a socket round trip, a wait for copy
  threads): the handler raises ``KeyboardInterrupt`` there, as Python's
  would, and the operation's clean-up runs as before; or
* any other code of the client or of ``shm``: bookkeeping, which runs in
  microseconds.  The handler has the signal marked as due again (by a
  thread of its own, with ``_thread.interrupt_main``, told through a pipe)
  and returns, so it is handled at the next check, until the code that
  checks is a wait or the application's own.

Only the main thread runs signal handlers; other threads are never
interrupted.  ``SharedTensor`` finalizers that run in other threads are
unaffected either way.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
# The code of this package and of the client, its sibling (tensordepot.shm,
# tensordepot.client: folders side by side, installed or editable).
_HERE = os.path.dirname(os.path.abspath(__file__))
_OURS = (_HERE + os.sep, os.path.join(os.path.dirname(_HERE), "client") + os.sep)
_WAITS: set[CodeType] = set()
_installed = False


def interruptible(fn: F) -> F:
    """Mark ``fn`` as a wait that a Ctrl-C may cut (its caller cleans up)."""
    _WAITS.add(fn.__code__)
    return fn


def _in_bookkeeping(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code in _WAITS:
            return False
        if code.co_filename.startswith(_OURS):
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _busy
    if _busy:  # run nested in the handler itself (a storm): the outer one decides
        return
    _busy = True
    try:
        if _in_bookkeeping(frame):
            _mark_due()  # the re-arming thread marks it due again, once this returns
            return
    finally:
        _busy = False
    raise KeyboardInterrupt


# The signal is marked due again from another thread: marked from within the
# handler, it would run the handler again at the handler's own next check,
# nested, without end.  A handler that runs nested all the same (the mark
# landed before it returned) finds its own frame, ours, and defers again.
# The handler tells that thread through a pipe, never through a lock: a
# handler nested inside another's ``Event.set`` (a storm of Ctrl-C) would
# wait forever on the lock the outer one holds.  A handler nested in the
# handler returns at once: the outer one has marked the signal due, or
# raises, and nesting without end would exhaust the stack.
_busy = False
_pipe: tuple[int, int] | None = None
_rearmer: threading.Thread | None = None


def _mark_due() -> None:
    if _pipe is None:
        return
    try:
        os.write(_pipe[1], b"\0")
    except OSError:  # full (it is due already), or closed
        pass


def _rearm(r: int) -> None:
    while True:
        try:
            if not os.read(r, 4096):
                return
        except OSError:
            return
        _thread.interrupt_main(signal.SIGINT)


def _start_rearmer() -> None:
    global _pipe, _rearmer
    old, _pipe = _pipe, os.pipe()
    os.set_blocking(_pipe[1], False)
    for fd in old or ():  # a forked child's copy of its parent's pipe
        os.close(fd)
    _rearmer = threading.Thread(
        target=_rearm, args=(_pipe[0],), name="tensordepot-sigint", daemon=True
    )
    _rearmer.start()


def _after_fork() -> None:
    if _installed and signal.getsignal(signal.SIGINT) is _handler:
        _start_rearmer()  # the parent's is not in the child


os.register_at_fork(after_in_child=_after_fork)


def install() -> None:
    """Put the handler in place of Python's default one (main thread only;
    a handler the application set is kept)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            _installed = True  # the application's own: left alone
            return
        _start_rearmer()
        signal.signal(signal.SIGINT, _handler)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        return
    _installed = True
