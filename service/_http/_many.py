"""Batches as columns: ``/v1/many/alloc``, ``/v1/many/publish``, ``/v1/many/put``
and ``/v1/many/get`` (``/v1/many/delete`` answers names only: routers/many.py).

A state dict is hundreds or thousands of tensors; a whole ``Handle`` model
per tensor, validated, built and serialised in the broker and again in the
client, would cost more than the tensors' bytes.  These routes carry the
facts as columns (``ManyAlloc``, ``ManyPublish``, ``BatchGet`` in;
``HandleColumns`` out, made by ``_render.columns``), so a batch costs a few
list operations per tensor.
The routers (routers/many.py) and
the fast lane (service/_http/_lane.py) call the functions here; ``*_now``
answers without awaiting, or returns None when the request must wait (a
new segment, an unpublished version).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic_core import to_json

from ..._errors import InvalidRequest
from ..._proto import MAX_WAIT
from ..._wire import BatchGet, ManyAlloc, ManyPublish
from .._registry._broker import Broker
from .._registry._records import Found, names_of, numbers_of
from .._registry._sessions import Caller
from ._render import columns


def alloc_now(
    broker: Broker, sid: str | None, who: Caller, req: ManyAlloc, request: str | None
) -> bytes | None:
    got = broker.try_alloc_many(sid, who, req, request)
    return None if got is None else columns(broker, [(v, None) for v in got], "writing")


async def alloc(
    broker: Broker, sid: str | None, who: Caller, req: ManyAlloc, request: str | None
) -> bytes:
    """``request``: the request id, which cancels the allocations if the
    answer is never read (``Broker.release``)."""
    got = await broker.alloc_many(sid, who, req, request)
    return columns(broker, [(v, None) for v in got], "writing")


def versions_of(published: Sequence[Found]) -> bytes:
    """``Versions`` for what a batch published (versions, or rows of packs), as JSON."""
    return to_json({"names": names_of(published), "versions": numbers_of(published)})


def publish(broker: Broker, sid: str | None, who: Caller, req: ManyPublish) -> bytes:
    if len(req.names) != len(req.versions):
        from ..._errors import InvalidRequest

        raise InvalidRequest(
            f"publish needs one version per name: {len(req.names)} names, "
            f"{len(req.versions)} versions"
        )
    return versions_of(
        broker.publish_many(sid, who, list(zip(req.names, req.versions, strict=True)))
    )


def put_now(
    broker: Broker,
    sid: str | None,
    who: Caller,
    req: ManyAlloc,
    data: memoryview,
) -> bytes | None:
    got = broker.try_put_many(sid, who, req, data)
    return None if got is None else versions_of(got)


async def put(
    broker: Broker,
    sid: str | None,
    who: Caller,
    req: ManyAlloc,
    data: memoryview,
) -> bytes:
    return versions_of(await broker.put_many(sid, who, req, data))


def wait_of(req: BatchGet) -> float | None:
    """The batch's deadline in seconds; None waits forever (also past ``MAX_WAIT``)."""
    return None if req.timeout is None or req.timeout > MAX_WAIT else req.timeout


def floors_of(req: BatchGet, floor: int | None) -> int | list[int]:
    """The batch's ``newer_than``: one per name from the body, or one for
    every name from the query (``floor_param``), not both."""
    if floor is None:
        return req.newer_than if req.newer_than is not None else 0
    if req.newer_than is not None:
        raise InvalidRequest(
            "newer_than is given twice: in the query (one version for every name) and in "
            "the body (one per name); give one of the two"
        )
    return floor


def get_now(
    broker: Broker,
    sid: str | None,
    who: Caller,
    req: BatchGet,
    request: str | None,
    floors: int | list[int],
    known: int = 0,
) -> bytes | None:
    """``floors``: ``floors_of``; ``known``: see ``columns``."""
    got = broker.try_get_many(sid, who, req.names, floors, request=request, wait=req.wait)
    return None if got is None else columns(broker, got, "ready", known)


async def get(
    broker: Broker,
    sid: str | None,
    who: Caller,
    req: BatchGet,
    request: str | None,
    timeout: float | None,
    gone: Callable[[], Awaitable[Any]] | None,
    floors: int | list[int],
    known: int = 0,
) -> bytes:
    got = await broker.get_many(
        sid,
        who,
        req.names,
        timeout,
        newer_than=floors,
        request=request,
        gone=gone,
        wait=req.wait,
    )
    return columns(broker, got, "ready", known)
