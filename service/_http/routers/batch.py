"""Batches as lists of handles (``/v1/batch/alloc`` and ``/publish``), the
first batch routes.  ``/v1/many/*`` carries the same facts as columns, for
less work per tensor: both clients use those, except ``put_many`` where a
GPU is involved (``client/_cuda_ops.py``), which still allocates and
publishes here.  (``/v1/batch/get``, which no client called, is gone.)"""

from __future__ import annotations

from ...._wire import BatchAlloc, BatchPublish, HandleList
from ..._auth import WRITE
from ..._registry._broker import Broker
from ..._registry._records import Version
from .._handler import Answer, Call, Reply, route, routes_of

TAG = "batch"


def _handles(broker: Broker, pairs: list[tuple[Version, int | None]]) -> bytes:
    return (
        HandleList(items=[broker.handle(v, lease) for v, lease in pairs]).model_dump_json().encode()
    )


@route(
    "POST",
    "/v1/batch/alloc",
    WRITE,
    "alloc_batch",
    tag=TAG,
    body=BatchAlloc,
    answers=HandleList,
    once=True,
    note="every name within the prefix",
    summary="Allocate many versions at once (all of them, or none)",
)
def batch_alloc(call: Call[BatchAlloc]) -> Reply:
    assert call.body is not None
    broker, sid, who, items = call.broker, call.session, call.who, call.body.items

    async def later() -> Answer:
        done: list[tuple[Version, int | None]] = []
        try:
            for item in items:
                done.append(await broker.alloc(sid, who, item, request=call.request_id))
        except BaseException:
            # All or nothing: a batch that does not fit leaves no half-written state dict.
            for v, hold in done:
                if hold is not None:
                    broker.release(sid, who, [hold])
                broker.abandon(v)
            raise
        return 200, _handles(broker, done)

    return later()


@route(
    "POST",
    "/v1/batch/publish",
    WRITE,
    "publish_batch",
    tag=TAG,
    body=BatchPublish,
    answers=HandleList,
    once=True,
    note="every name within the prefix",
    summary="Publish many versions at once (all of them, or none)",
)
def batch_publish(call: Call[BatchPublish]) -> Reply:
    assert call.body is not None
    broker = call.broker
    versions = broker.publish_many(
        call.session, call.who, [(i.name, i.version) for i in call.body.items]
    )
    return 200, _handles(broker, [(v, None) for v in versions])


ROUTES = routes_of(batch_alloc, batch_publish)
