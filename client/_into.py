"""Gets into tensors the caller owns: ``get(name, out=t)`` and
``get_many(names, out={name: t})``.

An inference engine keeps its parameter buffers and wants a new version
written into them.  Each tensor is leased, checked against its buffer
(shape and dtype, exactly: nothing is cast), copied, and its lease given
back at once.  Every buffer is checked before any is written, so a
mismatch leaves all of them as they were.

Buffers are numpy arrays, torch tensors (CPU or CUDA) and cupy arrays; jax
arrays cannot be written.  A CPU buffer that is C-contiguous is filled with
the client's copy threads (``copy_many``); others through their framework
(torch's ``copy_``, cupy's ``set``), which also copies between host and GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any

from .._errors import InvalidRequest, InvalidType
from ..shm._copy import copy_many
from . import _batch, _ops
from ._checks import check_names
from ._core import Core
from ._http import Offload, Op
from ._source import dtype_name, raw_view
from ._tensor import SharedTensor
from ._tensormap import TensorMap


def _kind(name: str, dst: Any) -> str:
    module = type(dst).__module__
    for kind in ("numpy", "torch", "cupy"):
        if module == kind or module.startswith(kind + "."):
            return kind
    raise InvalidType(
        f"out for {name!r} is a {type(dst).__module__}.{type(dst).__name__}: "
        f"get writes into numpy arrays, torch tensors and cupy arrays (jax arrays "
        f"cannot be written)"
    )


def check_out(names: list[str], out: Any) -> dict[str, Any]:
    """``out`` as a dict whose every key is among ``names``."""
    if not isinstance(out, Mapping):
        raise InvalidType(f"out must be a dict from name to tensor, not {type(out).__name__}")
    extra = [k for k in out if k not in set(names)]
    if extra:
        raise InvalidRequest(
            f"out names {extra[:5]!r}, which are not among the names asked "
            f"for: give out only for names you get"
        )
    return dict(out)


def into(got: MutableMapping[str, Any], out: Mapping[str, Any]) -> Any:
    """Copy each ``got[name]`` into ``out[name]`` and give its lease back;
    ``got`` with those names now mapping to their buffers.  Nothing is
    written unless every buffer matches.  If it raises, the caller releases
    what it got: nothing is returned, so no lease may outlive the error."""
    plan = [(name, got[name], dst, _check(name, got[name], dst)) for name, dst in out.items()]
    copy_many([(pair.dst, pair.src) for _, _, _, pair in plan if pair is not None])
    for name, t, dst, pair in plan:
        if pair is None:
            _framework_copy(name, t, dst)
    for name in out:
        got[name].release()
        got[name] = out[name]
    return got


def _check(name: str, t: SharedTensor, dst: Any) -> Any:
    """Refuse a buffer that does not match; the (raw destination, raw
    source) pair's source for the copy threads, or None for a copy through
    the buffer's framework."""
    kind = _kind(name, dst)
    try:
        have = dtype_name(dst.dtype)
    except InvalidRequest:
        have = str(dst.dtype)
    shape = tuple(int(d) for d in dst.shape)
    if have != t.dtype or shape != tuple(t.shape):
        raise InvalidRequest(
            f"out[{name!r}] is {have} of shape {list(shape)}, and {name!r} "
            f"v{t.version} is {t.dtype} of shape {list(t.shape)}: give a buffer "
            f"of that dtype and shape (nothing was written)"
        )
    if kind == "numpy" and not dst.flags.writeable:
        raise InvalidRequest(f"out[{name!r}] is a read-only numpy array (nothing was written)")
    if t.device != "cpu":
        if kind == "numpy":
            raise InvalidRequest(
                f"{name!r} is on {t.device}: get it into a torch or cupy "
                f"tensor, not numpy (nothing was written)"
            )
        return None
    if kind == "numpy" and dst.flags.c_contiguous:
        return _Pair(dst.reshape(-1).view("uint8"), raw_view(t))
    if kind == "torch" and dst.device.type == "cpu" and dst.is_contiguous() and dst.numel():
        import torch

        with torch.no_grad():
            return _Pair(dst.detach().reshape(-1).view(torch.uint8).numpy(), raw_view(t))
    return None


class _Pair:
    """What ``copy_many`` needs of a destination: its flat bytes."""

    __slots__ = ("dst", "src")

    def __init__(self, dst: Any, src: Any) -> None:
        self.dst, self.src = dst, src.reshape(-1).view("uint8")


def _framework_copy(name: str, t: SharedTensor, dst: Any) -> None:
    kind = _kind(name, dst)
    if kind == "torch":
        import torch
        from torch.utils.dlpack import from_dlpack

        with torch.no_grad():
            dst.copy_(from_dlpack(t))
    elif kind == "cupy":
        cupy = importlib.import_module("cupy")
        if t.device == "cpu":
            dst.set(raw_view(t).view(dst.dtype))
        else:
            dst[...] = cupy.from_dlpack(t)
    else:  # a numpy array that is not C-contiguous
        dst.view(raw_view(t).dtype)[...] = raw_view(t)


def get_into(
    core: Core, name: str, timeout: Any, newer_than: Any, version: Any, out: Any
) -> Op[Any]:
    """``get(name, out=buffer)``: the buffer, holding the version got."""
    t = yield from _ops.get(core, name, timeout, newer_than, version)
    try:
        got: dict[str, Any] = yield Offload(into, {name: t}, {name: out})
    except BaseException:
        t.release()
        raise
    return got[name]


def get_many_into(
    core: Core, names: Any, timeout: Any, newer_than: Any, wait: Any, out: Any
) -> Op[TensorMap]:
    """``get_many(names, out={name: buffer})``: the names in ``out`` map to
    their buffers, holding the versions got; the others to SharedTensors."""
    names = check_names(names)
    out = check_out(names, out)
    got = yield from _batch.get_many(core, names, timeout, newer_than, wait)
    try:
        filled: TensorMap = yield Offload(into, got, out)
    except BaseException:
        got.release()
        raise
    return filled
