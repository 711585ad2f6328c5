"""Arrow Flight for tensors in shared memory: addresses, and record batches without a copy.

A tensor crosses Arrow Flight as one ``uint8`` column; each record batch is
the next chunk of its C-ordered bytes.  The batches wrap the mapping itself
(``pyarrow.py_buffer`` over a numpy view exports the buffer protocol, and the
view keeps the mapping alive), so Flight serialises straight from the
broker's or the producer's shared memory.  Chunks of a few MiB let a 1 GiB
tensor pipeline: the receiver copies one chunk while the next is in flight.

Errors cross Flight in one shape, both ways (``to_flight``, ``flight_code``,
``flight_message``): a Flight error whose message is ours, one line, and
whose ``extra_info`` is our error code.  pyarrow sends the Python traceback,
file paths included, with any other exception a server handler raises, and
gRPC has no status of ours (Arrow Flight cannot send RESOURCE_EXHAUSTED, for
one): the code says what the status cannot.

pyarrow is imported here only: ``import tensordepot`` does not need it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .._errors import (
    CODES,
    AuthError,
    BrokerUnavailable,
    DepotError,
    Forbidden,
    InvalidRequest,
    TensorNotFound,
)

CHUNK = 4 << 20  # bytes per record batch
META_KEY = b"tensordepot"
COLUMN = "bytes"
INSTALL_HINT = "pip install 'tensordepot[flight]'"
SCHEMES = {"grpc": False, "grpc+tcp": False, "grpc+tls": True}  # scheme -> TLS
AUTH_CODES = (AuthError.code, Forbidden.code)  # the codes of a refused token


@dataclass(frozen=True)
class FlightURL:
    url: str
    host: str
    port: int
    tls: bool

    def location(self, port: int | None = None) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "grpc+tls" if self.tls else "grpc"
        return f"{scheme}://{host}:{self.port if port is None else port}"


def parse_flight_url(url: str, what: str = "--flight") -> FlightURL:
    """``grpc://HOST:PORT`` or ``grpc+tls://HOST:PORT``, or ValueError saying so."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if parts is None or parts.scheme not in SCHEMES or not parts.hostname or port is None:
        raise ValueError(f"{what} {url!r}: use grpc://HOST:PORT or grpc+tls://HOST:PORT")
    return FlightURL(url, parts.hostname, port, SCHEMES[parts.scheme])


def import_flight() -> Any:
    """``pyarrow.flight``, or ImportError saying how to install it."""
    try:
        return importlib.import_module("pyarrow.flight")
    except ImportError as exc:
        raise ImportError(
            f"moving tensors between hosts needs Arrow Flight ({exc}); {INSTALL_HINT}"
        ) from None


def schema(meta_json: str) -> Any:
    """The stream's schema: one uint8 column, the tensor's metadata as JSON."""
    import pyarrow as pa

    return pa.schema([(COLUMN, pa.uint8())], metadata={META_KEY: meta_json.encode()})


def meta_json(sch: Any) -> str:
    """The JSON that ``schema`` stored, or ValueError."""
    raw = (sch.metadata or {}).get(META_KEY)
    if raw is None or len(sch) != 1 or str(sch.field(0).type) != "uint8":
        raise ValueError(
            f"not a tensordepot stream: expected one uint8 column and "
            f"{META_KEY.decode()!r} metadata, got {sch}"
        )
    return bytes(raw).decode()


def batches(view: Any, sch: Any, chunk: int = CHUNK) -> Iterator[Any]:
    """Record batches over consecutive chunks of ``view`` (a flat uint8 numpy
    array), zero copy.  An empty view gives one empty batch."""
    import pyarrow as pa

    n = len(view)
    for off in range(0, max(n, 1), chunk):
        part = view[off : off + chunk]
        col = pa.Array.from_buffers(pa.uint8(), len(part), [None, pa.py_buffer(part)])
        yield pa.RecordBatch.from_arrays([col], schema=sch)


def chunk_array(batch: Any) -> Any:
    """The bytes of one received record batch as a uint8 numpy array (no copy)."""
    return batch.column(0).to_numpy(zero_copy_only=True)


def read_into(
    reader: Any,
    dst: Any,
    progress: Callable[[int], None] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> int:
    """Copy the record batches of a Flight reader into ``dst`` (a flat uint8
    numpy array) in order; returns the bytes copied.  ValueError if the stream
    holds more than ``dst``; InterruptedError once ``stopped()`` is true."""
    off, size = 0, len(dst)
    while True:
        if stopped is not None and stopped():
            raise InterruptedError("stopped before the stream ended")
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return off
        if chunk.data is None:  # a metadata-only message
            continue
        part = chunk_array(chunk.data)
        n = len(part)
        if off + n > size:
            raise ValueError(f"the stream holds more than the {size} bytes announced")
        dst[off : off + n] = part
        off += n
        if progress is not None:
            progress(n)


def to_flight(exc: DepotError) -> Exception:
    """``exc`` as the Flight error a server handler raises: its message and
    its code (``extra_info``), no traceback.  Auth and availability keep
    their gRPC status (UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE);
    everything else is UNKNOWN, told apart by the code."""
    fl = import_flight()
    cls: Any = fl.FlightServerError
    if isinstance(exc, Forbidden) or (isinstance(exc, AuthError) and exc.status == 403):
        cls = fl.FlightUnauthorizedError
    elif isinstance(exc, AuthError):
        cls = fl.FlightUnauthenticatedError
    elif isinstance(exc, BrokerUnavailable):
        cls = fl.FlightUnavailableError
    return cls(str(exc), exc.code.encode())  # type: ignore[no-any-return]


def flight_code(exc: BaseException) -> str:
    """The tensordepot error code a Flight error carries, or the one its
    status implies (a broker that sent no code: NOT_FOUND is ``not_found``,
    INVALID_ARGUMENT ``invalid_request``); "" when neither says."""
    import pyarrow as pa

    fl = import_flight()
    info = getattr(exc, "extra_info", None)
    code = info.decode("ascii", "replace") if isinstance(info, bytes) else ""
    if code in CODES:
        return code
    if isinstance(exc, fl.FlightUnauthenticatedError):
        return AuthError.code
    if isinstance(exc, fl.FlightUnauthorizedError):
        return Forbidden.code
    if isinstance(exc, pa.ArrowKeyError):
        return TensorNotFound.code
    if isinstance(exc, pa.ArrowInvalid):
        return InvalidRequest.code
    return ""


def flight_message(exc: BaseException) -> str:
    """A Flight error's own message, without what pyarrow and gRPC append."""
    msg = str(exc).split(". Detail:", 1)[0].split(". gRPC client debug context", 1)[0]
    return msg.strip() or type(exc).__name__
