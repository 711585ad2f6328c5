"""A Ctrl-C made to land at one chosen place, deterministically.

A real SIGINT lands wherever the interpreter happens to be, so a test that
sends one finds a narrow window only now and then.  ``interrupt_at`` raises
``KeyboardInterrupt`` in the calling thread at the ``nth`` call of a Python
function (its code object), as the signal handler would there: the call
never starts, and the exception propagates from the caller's line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any


@contextmanager
def interrupt_at(
    code: CodeType, nth: int = 1, where: Callable[[FrameType], bool] = lambda frame: True
) -> Iterator[None]:
    """Within the block, the ``nth`` call of ``code`` for which ``where(frame)``
    holds raises ``KeyboardInterrupt``.  Tracing ends there, or at the block's end."""
    calls = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal calls
        if event == "call" and frame.f_code is code and where(frame):
            calls += 1
            if calls == nth:
                sys.settrace(None)
                raise KeyboardInterrupt
        return None

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(None)
