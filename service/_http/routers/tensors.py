"""Tensors: allocate, publish, put, get (long poll), release, delete, list.

Each route below is its one and only implementation: both doors (the fast
lane and ASGI) call these handlers through the gate (service/_http/_gate.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ...._proto import MAX_WAIT, SESSION_HEADER
from ...._wire import (
    INLINE_MAX,
    NAME_PATTERN,
    AllocRequest,
    Handle,
    LinkRequest,
    PublishRequest,
    ReleaseRequest,
    TensorList,
    check_prefix,
)
from ..._auth import READ, WRITE
from .._handler import Answer, Call, Reply, get_params, put_params, route, routes_of
from .._render import handle_json

TAG = "tensors"


class Released(BaseModel):
    released: int


SESSION_PARAM = {
    "name": SESSION_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "the id from POST /v1/sessions",
}
NAME_PARAM = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": NAME_PATTERN},
    "description": "printable ASCII without spaces, 1 to 512 characters",
}
_GET_DOCS = {
    "parameters": [
        NAME_PARAM,
        {
            "name": "timeout",
            "in": "query",
            "required": False,
            "schema": {
                "anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "enum": ["inf"]}],
                "default": 0,
            },
            "description": (
                f"seconds to wait for a publish; 0: none; inf (or over {MAX_WAIT:g}): forever"
            ),
        },
        {
            "name": "newer_than",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "default": 0},
            "description": "only a version newer than this",
        },
        {
            "name": "version",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "default": 0},
            "description": "exactly this version, while a lease keeps it (0: the newest); no wait",
        },
        SESSION_PARAM,
    ]
}
_PUT_DOCS = {
    "parameters": [
        NAME_PARAM,
        {
            "name": "dtype",
            "in": "query",
            "required": True,
            "schema": {"type": "string", "maxLength": 40},
            "example": "float32",
        },
        {
            "name": "shape",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "maxLength": 400, "default": ""},
            "description": "comma-separated dims; empty for a scalar",
        },
        {
            "name": "ttl",
            "in": "query",
            "required": False,
            "schema": {"type": "number", "exclusiveMinimum": 0},
            "description": "delete this many seconds after publish",
        },
        SESSION_PARAM,
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": f"the tensor's C-ordered bytes, at most {INLINE_MAX}",
                }
            }
        },
    },
}


@route(
    "GET",
    "/v1/tensors/{name:path}",
    READ,
    "get_tensor",
    tag=TAG,
    answers=Handle,
    once=True,
    docs=_GET_DOCS,
    head=False,
    summary="Lease the newest published version, waiting up to `timeout` seconds",
)
def get_tensor(call: Call[Any]) -> Reply:
    name = call.params["name"]
    wait, newer_than, version = get_params(call.query)
    broker, sid, rid, who = call.broker, call.session, call.request_id, call.who
    if version:
        return 200, handle_json(broker, *broker.get_version(sid, who, name, version, request=rid))
    got = broker.try_get(sid, who, name, newer_than, request=rid)
    if got is not None:
        return 200, handle_json(broker, *got)

    async def later() -> Answer:
        # Watch for a hang-up only when the get will really wait.
        watch = wait != 0 and call.gone is not None and broker.ready(name, newer_than) is None
        v, lease = await broker.get(
            sid, who, name, wait, newer_than, request=rid, gone=call.gone if watch else None
        )
        return 200, handle_json(broker, v, lease)

    return later()


@route(
    "POST",
    "/v1/put/{name:path}",
    WRITE,
    "put_tensor",
    tag=TAG,
    answers=Handle,
    once=True,
    docs=_PUT_DOCS,
    summary="Allocate, fill and publish a small tensor in one round trip",
)
def put_tensor(call: Call[Any]) -> Reply:
    areq = put_params(call.params["name"], call.query, call.header(b"content-length") or "")
    broker, sid, who, data = call.broker, call.session, call.who, call.data
    v = broker.try_put_inline(sid, who, areq, data)
    if v is not None:
        return 200, handle_json(broker, v)

    async def later() -> Answer:
        return 200, handle_json(broker, await broker.put_inline(sid, who, areq, data))

    return later()


@route(
    "POST",
    "/v1/alloc",
    WRITE,
    "alloc_tensor",
    tag=TAG,
    body=AllocRequest,
    answers=Handle,
    once=True,
    summary="Allocate a new version (state 'writing') to fill in place",
)
def alloc(call: Call[AllocRequest]) -> Reply:
    assert call.body is not None
    broker, req = call.broker, call.body
    got = broker.try_alloc(call.session, call.who, req, request=call.request_id)
    if got is not None:  # it fits in memory the pool has: no task, no await
        return 200, handle_json(broker, *got)

    async def later() -> Answer:
        v, hold = await broker.alloc(call.session, call.who, req, request=call.request_id)
        return 200, handle_json(broker, v, hold)

    return later()


@route(
    "POST",
    "/v1/publish",
    WRITE,
    "publish_tensor",
    tag=TAG,
    body=PublishRequest,
    answers=Handle,
    once=True,
    summary="Make a written version visible",
)
def publish(call: Call[PublishRequest]) -> Reply:
    assert call.body is not None
    broker, req = call.broker, call.body
    return 200, handle_json(broker, broker.publish(call.session, call.who, req.name, req.version))


@route(
    "POST",
    "/v1/abort",
    WRITE,
    "abort_tensor",
    tag=TAG,
    body=PublishRequest,
    status=204,
    once=True,
    summary="Give back an allocated version that will not be published",
)
def abort(call: Call[PublishRequest]) -> Reply:
    assert call.body is not None
    call.broker.abort(call.session, call.who, call.body.name, call.body.version)
    return 204, b""


@route(
    "POST",
    "/v1/link",
    WRITE,
    "link_tensor",
    tag=TAG,
    body=LinkRequest,
    answers=Handle,
    once=True,
    note="the new name within the prefix",
    summary="Publish a leased version's bytes under another name, without a copy",
)
def link(call: Call[LinkRequest]) -> Reply:
    assert call.body is not None
    broker, req = call.broker, call.body
    return 200, handle_json(
        broker, broker.link(call.session, call.who, req.name, req.lease, req.ttl, req.source)
    )


@route(
    "POST",
    "/v1/release",
    READ,
    "release",
    tag=TAG,
    body=ReleaseRequest,
    answers=Released,
    note="the session's own leases",
    summary="Release leases, and cancel requests whose answers were never read",
)
def release(call: Call[ReleaseRequest]) -> Reply:
    assert call.body is not None
    broker, req = call.broker, call.body
    n = broker.release(call.session, call.who, req.leases, req.requests)
    if req.stale:
        n += broker.release_stale(call.who, req.stale)
    return 200, b'{"released":%d}' % n


@route(
    "GET",
    "/v1/tensors",
    READ,
    "list_tensors",
    tag=TAG,
    answers=TensorList,
    note="lists only names within the prefix",
    summary="List tensors",
    docs={
        "parameters": [
            {
                "name": "prefix",
                "in": "query",
                "required": False,
                "schema": {"type": "string", "pattern": NAME_PATTERN},
                "description": "only names that start with this",
            }
        ]
    },
)
def list_tensors(call: Call[Any]) -> Reply:
    principal = call.principal  # a prefix-limited token sees only its own names
    prefix = call.query.get("prefix", "")
    items = [
        i
        for i in call.broker.list(check_prefix(prefix) if prefix else "")
        if principal.may_use(i.name)
    ]
    return 200, TensorList(items=items).model_dump_json().encode()


@route(
    "DELETE",
    "/v1/tensors/{name:path}",
    WRITE,
    "delete_tensor",
    tag=TAG,
    status=204,
    docs={"parameters": [NAME_PARAM]},
    summary="Delete a name now; its memory is freed when the last reader releases it",
)
def delete_tensor(call: Call[Any]) -> Reply:
    call.broker.delete(call.params["name"], call.who)
    return 204, b""


ROUTES = routes_of(
    get_tensor, put_tensor, alloc, publish, abort, link, release, list_tensors, delete_tensor
)
