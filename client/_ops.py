"""The client's operations on one tensor or name, each written once as
steps (``_http.py``) that ``Client`` and ``AsyncClient`` drive: put, empty,
publish, get, share, delete, list, stat.  Arguments are checked here, at the
API boundary (``_checks.py``); request bodies are the wire models
(``tensordepot._wire``).

Bodies are made with ``model_construct`` from arguments checked here: the
broker validates every body it gets (one judge of its limits), and a second
validation would cost as much as the JSON itself on a 1,000-tensor batch.

Where work may not run on an event loop, an operation offloads it: the copy
of a put, mapping a tensor when that may wait (a GPU handle, a lock another
thread holds; else it maps in place, as cheap as any step), a GPU operation
whole (``Offload(core.run, ...)``: it runs blocking, on the core's own
transport).  What an operation allocated, it
gives back when a later step fails or its caller is cancelled.
"""

from __future__ import annotations

import builtins
from typing import Any
from urllib.parse import quote

from .._errors import InvalidRequest
from .._wire import (
    INLINE_MAX,
    AllocRequest,
    Deleted,
    Handle,
    Holder,
    HolderList,
    ManyDelete,
    Stat,
    TensorInfo,
    TensorList,
    check_prefix,
)
from ..shm._copy import copy_into
from ..shm._posix import array_at
from . import _cuda_handles, _cuda_ops
from ._checks import check_name, check_names, check_shape, check_timeout, check_ttl, check_version
from ._core import Core
from ._extent import check_extent
from ._http import Offload, Op
from ._shmlane import again, remember
from ._source import Source, dtype_name, typed
from ._tensor import SharedTensor

_QUOTED: dict[str, str] = {}


def path_name(name: str) -> str:
    """A tensor name as it goes in a URL path (percent-encoded, slashes kept);
    names repeat, and quoting costs more than the rest of building a request."""
    q = _QUOTED.get(name)
    if q is None:
        q = quote(name, safe="/")
        if len(_QUOTED) < 4096:
            _QUOTED[name] = q
    return q


def tensor(core: Core, h: Handle, writable: bool) -> SharedTensor:
    """The tensor of a handle from get, get_many or empty.  If it cannot be
    made, the caller gives back what the broker handed out."""
    t = (
        _cuda_handles.tensor(core, h, writable=writable)
        if h.kind == "cuda"
        else core.posix_tensor(h, writable=writable)
    )
    t._instance = core.instance  # the run of the broker it came from (pickles name it)
    return t


def _release(core: Core, h: Handle) -> None:
    if h.lease is not None and core.bg is not None:
        core.bg.release_later(core.sid, h.lease)


# -- writing ---------------------------------------------------------------------------------


def put(core: Core, name: str, x: Any, ttl: Any, device: Any, dtype: Any = None) -> Op[int]:
    check_name(name)
    ttl = check_ttl(ttl)
    x = typed(x, dtype)
    if _cuda_handles.involves_gpu([x], device):
        version: int = yield Offload(core.run, _cuda_ops.put(core, name, x, device=device, ttl=ttl))
        return version
    if isinstance(x, SharedTensor) and x._client() is core and x.published:
        # Already in broker memory: the new version shares the bytes, unless
        # x is leased in an earlier session (then it is copied below).
        linked = yield from core.link(name, x, ttl)
        if linked is not None:
            return linked
    src = Source(x)
    try:
        arr = src.array
        if arr.nbytes <= INLINE_MAX:  # the bytes ride in the request: one round trip
            query = f"dtype={src.dtype}&shape={','.join(map(str, arr.shape))}"
            if ttl is not None:
                query += f"&ttl={ttl!r}"
            answer = yield from core.call(
                "POST", f"/v1/put/{path_name(name)}?{query}", arr.tobytes(), rid=core.rid()
            )  # C order
            return int(answer["version"])
        body = AllocRequest.model_construct(
            name=name, shape=list(arr.shape), dtype=src.dtype, device="cpu", ttl=ttl, hold=False
        )
        h = yield from core.alloc(body, Handle)
        try:
            # When it raises, no copy thread still writes.
            yield Offload(_fill, core, h, arr, src.dtype)
        except BaseException:
            yield from core.abort(h.name, h.version)
            raise
    finally:
        src.close()  # what DLPack lent us, once nothing reads it any more
    try:
        yield from core.publish(name, h.version)
    except BaseException:
        # If the broker published it, the abort finds nothing to give back.
        yield from core.abort(h.name, h.version)
        raise
    return h.version


def _fill(core: Core, h: Handle, arr: Any, dtype: str) -> None:
    m = core.segments.fill_map(h.segment)
    check_extent(h, m.size, h.offset, h.nbytes, h.shape, h.strides, h.dtype, (arr.shape, dtype))
    if h.nbytes:
        dst = array_at(
            m.address + h.offset, tuple(h.shape), None, arr.dtype, writable=True, owner=m
        )
        copy_into(dst, arr)


def empty(core: Core, name: str, shape: Any, dtype: Any, device: Any, ttl: Any) -> Op[SharedTensor]:
    check_name(name)
    body = AllocRequest.model_construct(
        name=name,
        shape=check_shape(shape),
        dtype=dtype_name(dtype),
        ttl=check_ttl(ttl),
        device=_cuda_handles.wire_device(device),
        hold=True,
    )
    h = yield from core.alloc(body, Handle)
    try:
        if core.map_cheaply(h.kind):
            t = tensor(core, h, True)
        else:
            t = yield Offload(tensor, core, h, True)
    except BaseException:
        yield from core.give_back([h])
        raise
    return (yield from core.written(t, h))


def publish(core: Core, t: SharedTensor) -> Op[SharedTensor]:
    """Publish ``t``, an ``empty()`` tensor of ``core``."""
    if t._publishing() is not core:
        raise InvalidRequest(
            f"tensor {t.name!r} came from another client; publish it with that one"
        )
    if t.device != "cpu":  # a GPU tensor first waits for its writes, on the host
        return (yield Offload(t.publish))  # type: ignore[no-any-return]
    return (yield from core.publish_tensor(t))


def share(core: Core, name: str, x: Any, ttl: Any, stream: Any, wait_on_close: float) -> Op[int]:
    check_name(name)
    op = _cuda_ops.share(
        core, name, x, ttl=check_ttl(ttl), stream=stream, wait_on_close=wait_on_close
    )
    return (yield Offload(core.run, op))  # type: ignore[no-any-return]


# -- reading ---------------------------------------------------------------------------------


def get(
    core: Core, name: str, timeout: Any, newer_than: Any, version: Any = None
) -> Op[SharedTensor]:
    check_name(name)
    wait = check_timeout(timeout)
    floor = check_version(newer_than)
    path = f"/v1/tensors/{path_name(name)}?newer_than={floor}"
    io: float | bool | None = False  # the transport's own timeout
    exact = check_version(version, "version")
    if exact:
        if wait != 0 or path[-2:] != "=0":
            raise InvalidRequest(
                f"get({name!r}, version={exact}) names one version, now: "
                f"give it without timeout or newer_than"
            )
        path = f"/v1/tensors/{path_name(name)}?version={exact}"
    elif wait is None:
        path, io = path + "&timeout=inf", None
    elif wait > 0:
        path, io = path + f"&timeout={wait!r}", wait + core.timeout
    h = None if exact else again(core, name, floor)
    if h is None:
        h = yield from core.granted(Handle, "GET", path, timeout=io)
        remember(core, h)
    try:
        if core.map_cheaply(h.kind):
            return tensor(core, h, False)
        t: SharedTensor = yield Offload(tensor, core, h, False)
    except BaseException:
        _release(core, h)
        raise
    return t


# -- names -----------------------------------------------------------------------------------


def delete(core: Core, name: str | None, prefix: str | None = None) -> Op[builtins.list[str]]:
    """One name (``name``) or every name with ``prefix``: the names deleted."""
    if (name is None) == (prefix is None):
        raise InvalidRequest(
            "delete takes a name or prefix=, one of the two: delete('w'), "
            "delete(prefix='run1/'); for many names use delete_many"
        )
    if name is not None:
        check_name(name)
        yield from core.call("DELETE", f"/v1/tensors/{path_name(name)}", rid=core.rid())
        return [name]
    body = ManyDelete.model_construct(names=None, prefix=check_prefix(prefix))
    return Deleted.model_validate_json(
        (yield from core.call("POST", "/v1/many/delete", body, rid=core.rid(), raw=True))
    ).names


def delete_many(core: Core, names: Any) -> Op[builtins.list[str]]:
    """Every one of ``names``, or (one missing) none: the names deleted."""
    body = ManyDelete.model_construct(names=check_names(names, "delete()"), prefix=None)
    if not body.names:
        return []
    return Deleted.model_validate_json(
        (yield from core.call("POST", "/v1/many/delete", body, rid=core.rid(), raw=True))
    ).names


def names(core: Core, prefix: str = "") -> Op[builtins.list[TensorInfo]]:
    path = f"/v1/tensors?prefix={quote(check_prefix(prefix), safe='')}" if prefix else "/v1/tensors"
    return TensorList.model_validate_json((yield from core.call("GET", path, raw=True))).items


def stat(core: Core) -> Op[Stat]:
    return Stat.model_validate_json((yield from core.call("GET", "/v1/stat", raw=True)))


def who(core: Core) -> Op[builtins.list[Holder]]:
    return HolderList.model_validate_json((yield from core.call("GET", "/v1/who", raw=True))).items
