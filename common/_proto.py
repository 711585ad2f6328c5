"""Wire constants and limits that the broker and the client share.

Headers, error codes that change client behaviour, the framing of a body
that carries bytes after its JSON head, and the reading of
``/proc/<pid>/stat`` live here once, so the two sides cannot drift apart.
Every limit below is documented in the README ("Limits").
"""

from __future__ import annotations

from typing import Any

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

# -- limits (the broker enforces them; the client stays within them) --------
MAX_HEADER_BYTES = 64 * 1024  # a request's head; beyond it: 431
MAX_BODY_BYTES = 16 * 1024 * 1024  # a request's body; beyond it: 413
MAX_RELEASE_IDS = 4096  # lease or request ids on one request's headers
# The bytes a batch may carry in its request (``/v1/many/put``, ``frame``);
# larger batches go through /v1/many/alloc + /v1/many/publish.  A client sends
# its bytes only when its tensors average at most INLINE_BATCH_MEAN: bytes in
# the request cost copies (client, socket, broker) that a mapped copy does not,
# and pay off where the batch's tensors are many and small (README, B8).
INLINE_BATCH_MAX = 1 << 20
INLINE_BATCH_MEAN = 16 * 1024
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
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return int(rest[19]), rest[0].decode()
    except (IndexError, ValueError):
        return None


# -- framed bodies (/v1/many/put) -------------------------------------------
_FRAME_HEAD = 4  # the length of a framed body's JSON head, big-endian


def frame(head: bytes, parts: list[Any]) -> bytes:
    """A framed body (``/v1/many/put``): the length of ``head`` in 4 bytes,
    big-endian, then ``head`` (JSON), then ``parts`` (bytes-like), back to back."""
    return b"".join([len(head).to_bytes(_FRAME_HEAD, "big"), head, *parts])


def unframe(data: bytes) -> tuple[bytes, memoryview]:
    """(the JSON head, the bytes after it) of a framed body; raises ValueError
    that says what is wrong."""
    if len(data) < _FRAME_HEAD:
        raise ValueError(
            f"the body has {len(data)} bytes: a framed body starts with the length "
            f"of its JSON head in {_FRAME_HEAD} bytes, big-endian"
        )
    n = int.from_bytes(data[:_FRAME_HEAD], "big")
    if _FRAME_HEAD + n > len(data):
        raise ValueError(
            f"the body's first {_FRAME_HEAD} bytes say its JSON head has {n} bytes, "
            f"but only {len(data) - _FRAME_HEAD} follow them"
        )
    view = memoryview(data)
    return bytes(view[_FRAME_HEAD : _FRAME_HEAD + n]), view[_FRAME_HEAD + n :]


# Reason phrases of the statuses the broker answers with (RFC 9110).
REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    410: "Gone",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    507: "Insufficient Storage",
}
