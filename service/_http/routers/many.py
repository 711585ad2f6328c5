"""Batches as columns: a state dict in one round trip per step, cheap per
tensor (service/_http/_many.py)."""

from __future__ import annotations

from ...._proto import INLINE_BATCH_MAX
from ...._wire import (
    BatchGet,
    Deleted,
    HandleColumns,
    ManyAlloc,
    ManyDelete,
    ManyPublish,
    Versions,
)
from ..._auth import READ, WRITE
from .. import _many
from .._handler import Answer, Call, Reply, floor_param, known_param, route, routes_of

TAG = "batch"


@route(
    "POST",
    "/v1/many/alloc",
    WRITE,
    "alloc_many",
    tag=TAG,
    body=ManyAlloc,
    kept=True,
    answers=HandleColumns,
    once=True,
    note="every name within the prefix",
    summary="Allocate a version of each tensor, on the host or a GPU (all of them, or none)",
)
def alloc_many(call: Call[ManyAlloc]) -> Reply:
    assert call.body is not None
    broker, sid, who, body, rid = call.broker, call.session, call.who, call.body, call.request_id
    out = _many.alloc_now(broker, sid, who, body, rid)
    if out is not None:
        return 200, out

    async def later() -> Answer:
        return 200, await _many.alloc(broker, sid, who, body, rid)

    return later()


@route(
    "POST",
    "/v1/many/publish",
    WRITE,
    "publish_many",
    tag=TAG,
    body=ManyPublish,
    answers=Versions,
    once=True,
    note="every name within the prefix",
    summary="Publish many versions at once (all of them, or none)",
)
def publish_many(call: Call[ManyPublish]) -> Reply:
    assert call.body is not None
    return 200, _many.publish(call.broker, call.session, call.who, call.body)


_PUT_DOCS = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": (
                        "framed: the length of a JSON head in 4 bytes, big-endian; the head "
                        "(a ManyAlloc: names, shapes, dtypes, ttl, same); then each tensor's "
                        "C-ordered bytes, in order, none for a tensor that is an earlier one's "
                        f"(same), at most {INLINE_BATCH_MAX} bytes in all"
                    ),
                }
            }
        },
    }
}


@route(
    "POST",
    "/v1/many/put",
    WRITE,
    "put_many",
    tag=TAG,
    body=ManyAlloc,
    framed=True,
    answers=Versions,
    once=True,
    docs=_PUT_DOCS,
    note="every name within the prefix",
    summary="Allocate, fill and publish a batch of small tensors in one round trip (all of "
    "them, or none)",
)
def put_many(call: Call[ManyAlloc]) -> Reply:
    assert call.body is not None and call.rest is not None
    broker, sid, who, body, data = call.broker, call.session, call.who, call.body, call.rest
    out = _many.put_now(broker, sid, who, body, data)
    if out is not None:
        return 200, out

    async def later() -> Answer:
        return 200, await _many.put(broker, sid, who, body, data)

    return later()


@route(
    "POST",
    "/v1/many/get",
    READ,
    "get_many",
    tag=TAG,
    body=BatchGet,
    answers=HandleColumns,
    once=True,
    kept=True,
    note="every name within the prefix",
    summary="Lease many tensors at once, under one deadline (all of them, or none)",
    docs={
        "parameters": [
            {
                "name": "newer_than",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 0},
                "description": "one version for every name: only versions newer than it (waits "
                "for them), instead of the body's newer_than per name (not both)",
            },
            {
                "name": "known",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 0, "default": 0},
                "description": "the key of an earlier answer's columns that the client holds for "
                "these names in this order: an answer of the same pack's rows leaves out names, "
                "pack, at, layouts and layout (0: none)",
            },
        ]
    },
)
def get_many(call: Call[BatchGet]) -> Reply:
    assert call.body is not None
    broker, sid, who, body, rid = call.broker, call.session, call.who, call.body, call.request_id
    known = known_param(call.query)
    floors = _many.floors_of(body, floor_param(call.query))
    out = _many.get_now(broker, sid, who, body, rid, floors, known)
    if out is not None:
        return 200, out
    timeout = _many.wait_of(body)

    async def later() -> Answer:
        gone = None if timeout == 0 else call.gone
        return 200, await _many.get(broker, sid, who, body, rid, timeout, gone, floors, known)

    return later()


@route(
    "POST",
    "/v1/many/delete",
    WRITE,
    "delete_many",
    tag=TAG,
    body=ManyDelete,
    answers=Deleted,
    once=True,
    note="every name (or the prefix) within the token's prefix",
    summary="Delete many names at once: those listed (all of them, or none), or every name "
    "with a prefix",
)
def delete_many(call: Call[ManyDelete]) -> Reply:
    body = call.body
    assert body is not None
    if body.prefix is not None:
        names = call.broker.delete_prefix(body.prefix, call.who)
    else:
        names = call.broker.delete_many(body.names or [], call.who)
    return 200, Deleted(names=names).model_dump_json().encode()


ROUTES = routes_of(alloc_many, publish_many, put_many, get_many, delete_many)
