"""Wire constants and limits that the broker and the client share.

Headers, error codes that change client behaviour, and the reading of
``/proc/<pid>/stat`` live here once, so the two sides cannot drift apart.
Every limit below is documented in the README ("Limits").
"""

from __future__ import annotations

# -- headers ---------------------------------------------------------------
SESSION_HEADER = "x-tensordepot-session"
# Lease ids the client dropped since its last request: "1,2,3".
RELEASE_HEADER = "x-tensordepot-release"
# Request ids whose answer the client never read (Ctrl-C, a client-side
# timeout): any lease granted to them is released.
CANCEL_HEADER = "x-tensordepot-cancel"
# A client-chosen id that makes a request idempotent: a resend with the same
# id within the same session gets the first answer instead of a second effect.
REQUEST_HEADER = "x-tensordepot-request"
# Every broker response carries this header, so a client can tell a
# tensordepot broker from some other HTTP server on the same URL.
SERVER_HEADER = "x-tensordepot-broker"

# -- error codes the client acts on ----------------------------------------
UNKNOWN_SESSION = "unknown_session"

# -- limits (the broker enforces them; the client stays within them) --------
MAX_HEADER_BYTES = 64 * 1024  # a request's head; beyond it: 431
MAX_BODY_BYTES = 16 * 1024 * 1024  # a request's body; beyond it: 413
MAX_RELEASE_IDS = 4096  # lease or request ids on one request's headers
MAX_WAIT = 1e7  # seconds; a longer timeout means "forever"
REQUEST_CACHE = 64  # answers kept per session for resends of the same request id


def proc_stat(pid: int, proc: str = "/proc") -> tuple[int, str] | None:
    """(start time, state) of ``pid`` from ``/proc/<pid>/stat``, or None if gone.

    The start time (field 22, clock ticks since boot) tells a reused pid from
    the process that opened a session; state Z or X is a dead process its
    parent has not reaped yet."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19]), rest[0].decode()
    except (IndexError, ValueError):
        return None
