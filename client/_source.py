"""What a put accepts: anything array-like, seen as a numpy array of the right
item size without a copy (DLPack for torch, jax, cupy host arrays)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequest, InvalidType
from ..shm import UnsupportedDType, dtype_from_name, dtype_from_numpy, import_dlpack
from ..shm._dtypes import AmbiguousDType
from ..shm._posix import array_at
from ._checks import shown

if TYPE_CHECKING:
    from ._tensor import SharedTensor

_KINDS = (
    "a numpy array, a torch/jax/cupy tensor, anything with __dlpack__, or a number or list "
    "of numbers with dtype="
)
_PYTHON = (bool, int, float, complex, list, tuple)  # values whose dtype would be a guess


class Source:
    """A put's input as a numpy array of the right item size, plus its dtype.
    ``close()`` gives back what DLPack lent us."""

    def __init__(self, x: Any, what: str = "x") -> None:
        import numpy as np

        from ._tensor import SharedTensor

        self._imported = None
        refuse_masked(x, what)
        if isinstance(x, SharedTensor):  # another client's, or an empty() one: copy its raw bytes
            self.array, self.dtype = raw_view(x), x.dtype
        elif isinstance(x, np.ndarray):
            self.array, self.dtype = x, _numpy_dtype(x.dtype, what)
        elif hasattr(x, "__dlpack__"):
            x = _exportable(x, what)
            self._imported = import_dlpack(x)
            self.array, self.dtype = self._imported.array, self._imported.dtype.name
        elif isinstance(x, np.generic):
            arr = np.asarray(x)
            self.array, self.dtype = arr, _numpy_dtype(arr.dtype, what)
        elif isinstance(x, _PYTHON):
            raise InvalidType(
                f"{what} is a Python {type(x).__name__} ({shown(x)}), whose dtype "
                f"would be a guess (int64 or int32? float64 or float32?); pass "
                f"dtype=, as in put(name, {what}, dtype='float32'), or a numpy "
                f"array of the dtype you mean, np.asarray({what}, dtype='float32')"
            )
        else:
            raise InvalidType(f"{what} must be {_KINDS}; not {type(x).__name__} {shown(x)}")

    def close(self) -> None:
        if self._imported is not None:
            self._imported.close()
            self._imported = None


def refuse_masked(x: Any, what: str) -> None:
    """A masked array has two readings (its raw bytes, or its bytes with the
    fill value where masked): refuse it, and say how to pick one."""
    ma = sys.modules.get("numpy.ma")  # not imported: x cannot be a masked array
    if ma is not None and isinstance(x, ma.MaskedArray):
        raise InvalidType(
            f"{what} is a numpy masked array, which tensordepot does not store "
            f"(the mask would be lost); pass {what}.filled(value) for its values "
            f"with masked entries replaced, or {what}.data for its raw values"
        )


def refuse_unstrided(x: Any, what: str) -> None:
    """A torch tensor that is not one strided block of bytes (nested, sparse,
    quantized, or on the meta device, which holds no bytes) cannot cross
    DLPack: refuse it, and say what to put instead."""
    torch = sys.modules.get("torch")
    if torch is None:  # not imported: x cannot be a torch tensor
        return
    if getattr(x, "is_nested", False):
        kind, hint = (
            "a nested torch tensor (its tensors have shapes of their own)",
            f"put them as a batch: put_many({{f'name.{{i}}': t for i, t in "
            f"enumerate({what}.unbind())}})",
        )
    elif getattr(x, "layout", torch.strided) != torch.strided:
        kind, hint = (
            f"a sparse torch tensor (layout {x.layout})",
            f"pass {what}.to_dense(), or put its index and value tensors as a batch with put_many",
        )
    elif getattr(x, "is_quantized", False):
        kind, hint = (
            f"a quantized torch tensor ({x.dtype}: its scale and zero point would be lost)",
            f"pass {what}.dequantize(), or {what}.int_repr() and keep the scale and zero "
            f"point yourself",
        )
    elif getattr(x, "is_meta", False):
        kind, hint = (
            "on torch's meta device (it holds no bytes)",
            f"to place a tensor of its shape and dtype, use empty(name, {what}.shape, "
            f"{what}.dtype), fill it and publish() it",
        )
    else:
        return
    raise InvalidType(f"{what} is {kind}, which tensordepot does not store: {hint}")


def _numpy_dtype(dt: Any, what: str) -> str:
    try:
        return dtype_from_numpy(dt).name
    except UnsupportedDType as exc:
        raise InvalidRequest(
            f"{what} has dtype {dt}, which tensordepot cannot store ({exc})"
        ) from None


def raw_view(t: SharedTensor) -> Any:
    """The tensor's bytes as a numpy array of its storage type (no ml_dtypes needed)."""
    owner = t._alive()
    return array_at(
        t._address,
        t.shape,
        tuple(s * t._dt.itemsize for s in t.strides),
        t._dt.storage,
        writable=False,
        owner=owner,
    )


def _exportable(x: Any, what: str) -> Any:
    """torch refuses to export tensors that need grad or carry lazy conj/neg
    bits: resolved here.  Those with no strided bytes of their own it would
    refuse with an error of its own: refused here, saying what to pass."""
    if type(x).__module__.startswith("torch"):
        refuse_unstrided(x, what)
        if getattr(x, "requires_grad", False):
            x = x.detach()
        if hasattr(x, "resolve_conj"):
            x = x.resolve_conj().resolve_neg()
    return x


def typed(x: Any, dtype: Any, what: str = "x") -> Any:
    """put's ``dtype=``: Python numbers and lists as a numpy array of it; any
    other input must already have it (dtype= never converts a tensor)."""
    if dtype is None:
        return x
    name = dtype_name(dtype)
    if isinstance(x, _PYTHON):
        import numpy as np

        from ..shm import numpy_dtype

        try:
            return np.asarray(x, dtype=numpy_dtype(dtype_from_name(name)))
        except UnsupportedDType as exc:
            raise InvalidRequest(str(exc)) from None
        except (ValueError, TypeError, OverflowError) as exc:  # ragged, or out of range
            raise InvalidRequest(f"{what} cannot be made a {name} array: {exc}") from None
    have = getattr(x, "dtype", None)
    try:
        same = have is not None and dtype_name(have) == name
    except InvalidRequest:
        same = False
    if not same:
        raise InvalidRequest(
            f"{what} has dtype {have}, not {name}: dtype= types Python numbers "
            f"and lists only; convert a tensor first (x.astype, x.to)"
        )
    return x


def dtype_name(dtype: Any) -> str:
    if dtype is None:  # numpy reads None as float64: never guess
        raise InvalidType(
            "dtype is None: name one, such as 'float32' or 'bfloat16', or pass a numpy/torch dtype"
        )
    try:
        return dtype_from_name(str(dtype)).name
    except AmbiguousDType as exc:  # numpy would read it one way: never guess
        raise InvalidRequest(str(exc)) from None
    except UnsupportedDType:
        pass
    try:
        return dtype_from_numpy(dtype).name
    except (UnsupportedDType, TypeError):
        raise InvalidRequest(
            f"unknown dtype {shown(dtype)}; use a name such as 'float32' or "
            f"'bfloat16', or a numpy/torch dtype"
        ) from None
