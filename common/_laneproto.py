"""The records of the shared-memory lane (docs/plan-lane.md), as both sides
write and read them in the lane's rings (``shm._ring``).

A request record is an HTTP request without HTTP: the method, the target
(path and query, as sent over HTTP), the headers the gate reads (session,
request id, riders, content type, token) and the body.  The broker's lane
door hands them to the same gate as its other doors, so every rule is the
one the HTTP doors run.  An answer record is the status, the media kind
and the body the gate made.

Request: ``<HHQ`` (op ``OP_REQUEST``, flags 0, seq), the method (u8 length
and ASCII), the target (u16 length and bytes), the headers (u8 count, each
a u8 length and a lower-case ASCII name, a u16 length and the value),
then the body (the rest).  Answer: ``<HHQ`` (status, ``MEDIA_JSON`` or
``MEDIA_OTHER``, seq), then the body.  Little-endian throughout.

An answer of media ``MEDIA_HTTP`` (no body) says that the answer did not
fit the answer ring (a large batch, or a ring still holding answers the
client gave up on): the client sends the same request over HTTP, where its
request id gives it the very answer the broker kept (every lane op but
``stat``, which may simply run again, is replayed by its request id).

The other side may write anything: ``parse_request`` and ``parse_answer``
read only within the record they are given (copied out of the ring
already) and raise ``LaneGarbled`` for whatever a well-behaved peer never
writes."""

from __future__ import annotations

import struct

OP_REQUEST = 1
MEDIA_JSON, MEDIA_OTHER, MEDIA_HTTP = 0, 1, 2
_HEAD = struct.Struct("<HHQ")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
MAX_HEADERS = 16
SEQ_MOD = 1 << 64


class LaneGarbled(Exception):
    """A record no well-behaved peer writes: why."""


def request_record(
    seq: int, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """A request record (module doc)."""
    return b"".join(request_parts(seq, method, target, headers, body))


def request_parts(
    seq: int, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> list[bytes]:
    """A request record as two parts, to be written back to back: all but
    the body, then the body (not copied here)."""
    m, t = method.encode("ascii"), target.encode("latin-1")
    out = [_HEAD.pack(OP_REQUEST, 0, seq), _U8.pack(len(m)), m, _U16.pack(len(t)), t]
    out.append(_U8.pack(len(headers)))
    for name, value in headers:
        out += [_U8.pack(len(name)), name, _U16.pack(len(value)), value]
    return [b"".join(out), body]


def parse_request(rec: bytes) -> tuple[int, str, str, bytes, dict[bytes, bytes], memoryview]:
    """(seq, method, path, query, headers, body) of a request record; raises
    ``LaneGarbled``.  The path is percent-decoded, as the HTTP doors decode
    it; the first of repeated headers wins, as there.  The body is a view
    of ``rec``, not a copy."""
    try:
        op, flags, seq = _HEAD.unpack_from(rec, 0)
        if op != OP_REQUEST or flags:
            raise LaneGarbled(f"a record of op {op} with flags {flags}")
        at = _HEAD.size
        (n,) = _U8.unpack_from(rec, at)
        method = _ascii(rec[at + 1 : at + 1 + n], "method", n)
        at += 1 + n
        (n,) = _U16.unpack_from(rec, at)
        target = rec[at + 2 : at + 2 + n]
        if len(target) != n or not target.startswith(b"/"):
            raise LaneGarbled("a request's target is not a path")
        at += 2 + n
        (count,) = _U8.unpack_from(rec, at)
        at += 1
        if count > MAX_HEADERS:
            raise LaneGarbled(f"a request with {count} headers (at most {MAX_HEADERS})")
        headers: dict[bytes, bytes] = {}
        for _ in range(count):
            (n,) = _U8.unpack_from(rec, at)
            name = rec[at + 1 : at + 1 + n]
            _ascii(name, "header name", n)
            if name != name.lower():
                raise LaneGarbled("a header name is not lower case")
            at += 1 + n
            (n,) = _U16.unpack_from(rec, at)
            value = rec[at + 2 : at + 2 + n]
            if len(value) != n:
                raise LaneGarbled("a header runs past the record")
            headers.setdefault(name, value)
            at += 2 + n
    except struct.error:
        raise LaneGarbled("a request record cut short") from None
    path, _, query = target.partition(b"?")
    text = path.decode("latin-1")
    if "%" in text:
        import urllib.parse

        text = urllib.parse.unquote(text)
    return seq, method, text, query, headers, memoryview(rec)[at:]


def answer_record(seq: int, status: int, media: int, body: bytes) -> list[bytes]:
    """An answer record (module doc), as two parts to write back to back."""
    return [_HEAD.pack(status, media, seq), body]


def parse_answer(rec: bytes) -> tuple[int, int, int, bytes]:
    """(seq, status, media, body) of an answer record; raises ``LaneGarbled``."""
    if len(rec) < _HEAD.size:
        raise LaneGarbled("an answer record cut short")
    status, media, seq = _HEAD.unpack_from(rec, 0)
    if not 100 <= status <= 599 or media not in (MEDIA_JSON, MEDIA_OTHER, MEDIA_HTTP):
        raise LaneGarbled(f"an answer of status {status}, media {media}")
    return seq, status, media, rec[_HEAD.size :]


def _ascii(raw: bytes, what: str, n: int) -> str:
    if len(raw) != n or not n or not raw.isascii() or (what == "method" and not raw.isalpha()):
        raise LaneGarbled(f"a request's {what} is not ASCII")
    return raw.decode("ascii")
