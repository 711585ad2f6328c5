"""Pushing a tensor to a broker on another host with Arrow Flight's ``DoPut``.

The bytes go from this process's read-only mapping of the local broker's
segment into Flight's stream without a copy (``shm/_arrow.py``); the other
broker allocates, fills and publishes them as its next version of the name.
pyarrow is imported only when a push happens.  A push is one operation run
whole in one thread (an asyncio caller's worker thread): Flight's client
blocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._defaults import ENV_PREFIX
from .._errors import (
    AuthError,
    BrokerUnavailable,
    DepotError,
    Forbidden,
    InvalidRequest,
    OutOfMemory,
    TensorNotFound,
)
from .._wire import FlightMeta
from ..shm._arrow import (
    AUTH_CODES,
    batches,
    flight_code,
    flight_message,
    import_flight,
    parse_flight_url,
    schema,
)
from ..shm._posix import array_at
from . import _ops
from ._core import Core
from ._http import Offload, Op

ENV_PEER_TOKEN = ENV_PREFIX + "PEER_TOKEN"


def _error(to: str, name: str, exc: Exception) -> DepotError:
    """What the broker at ``to`` answered, as our error (``shm/_arrow.py`` reads its code)."""
    code, msg = flight_code(exc), flight_message(exc)
    if code in AUTH_CODES:
        cls = Forbidden if code == Forbidden.code else AuthError
        return cls(
            f"the broker at {to} refused the push of {name!r}: {msg}; pass token= (or "
            f"--to-token, $TENSORDEPOT_PEER_TOKEN) with write scope"
        )
    if code == InvalidRequest.code:
        return InvalidRequest(f"the broker at {to} refused {name!r}: {msg}")
    if code == TensorNotFound.code:
        return TensorNotFound(f"the broker at {to}: {msg}")
    if code == OutOfMemory.code:
        return OutOfMemory(f"the broker at {to} has no room for {name!r}: {msg}")
    return BrokerUnavailable(f"push of {name!r} to {to} failed: {msg}")


def push(
    core: Core,
    name: str,
    to: str,
    token: str | None,
    tls_ca: str | bytes | None,
    timeout: float | None,
) -> Op[int]:
    """Send the newest version of ``name`` to the broker whose Flight endpoint
    is ``to``; return the version it has there."""
    return (yield Offload(core.run, _push(core, name, to, token, tls_ca, timeout)))  # type: ignore[no-any-return]


def _push(
    core: Core,
    name: str,
    to: str,
    token: str | None,
    tls_ca: str | bytes | None,
    timeout: float | None,
) -> Op[int]:
    import pyarrow as pa

    fl = import_flight()
    try:
        url = parse_flight_url(to, "push to")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    token = token if token is not None else os.environ.get(ENV_PEER_TOKEN)
    if isinstance(tls_ca, str):
        with open(tls_ca, "rb") as f:
            tls_ca = f.read()
    t = yield from _ops.get(core, name, 0.0, 0)
    try:
        answer = _send(fl, pa, t, name, to, url, token, tls_ca, timeout)
    finally:
        t.release()
    if isinstance(answer, DepotError):
        # Raised here, not where it happened: the error's traceback then holds
        # no frame whose locals still view the tensor, so its lease goes now.
        raise answer
    return answer


def _send(
    fl: Any,
    pa: Any,
    t: Any,
    name: str,
    to: str,
    url: Any,
    token: str | None,
    tls_ca: str | bytes | None,
    timeout: float | None,
) -> int | DepotError:
    """The DoPut of ``t``: the version it has there, or the error to raise."""
    meta = FlightMeta(
        name=name, version=t.version, shape=list(t.shape), dtype=t.dtype, nbytes=t.nbytes
    )
    # The bytes in C order: get() always hands out C-contiguous tensors.  The
    # view holds the lease until the last batch that wraps it is gone.
    flat = array_at(t._address, (t.nbytes,), None, "|u1", writable=False, owner=t._alive())
    sch = schema(meta.model_dump_json())
    headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
    options = fl.FlightCallOptions(timeout=timeout, headers=headers)
    conn = fl.FlightClient(url.location(), tls_root_certs=tls_ca if url.tls else None)
    try:
        writer, reader = conn.do_put(fl.FlightDescriptor.for_path(name), sch, options)
        try:
            for batch in batches(flat, sch):
                writer.write_batch(batch)
            writer.done_writing()
            answer = reader.read()
        finally:
            writer.close()
        if answer is None:
            return BrokerUnavailable(f"the broker at {to} did not confirm the push of {name!r}")
        return int(json.loads(answer.to_pybytes())["version"])
    except (pa.ArrowException, ValueError, KeyError) as exc:
        return _error(to, name, exc)
    finally:
        conn.close()
