"""What a put accepts: anything array-like, seen as a numpy array of the right
item size without a copy (DLPack for torch, jax, cupy host arrays)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequest, InvalidType
from ..shm import UnsupportedDType, dtype_from_name, dtype_from_numpy, import_dlpack
from ..shm._posix import array_at
from ._checks import shown

if TYPE_CHECKING:
    from ._tensor import SharedTensor

_KINDS = ("a numpy array, a torch/jax/cupy tensor, anything with __dlpack__, or a number or list "
          "of numbers")


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
            x = _exportable(x)
            self._imported = import_dlpack(x)
            self.array, self.dtype = self._imported.array, self._imported.dtype.name
        elif isinstance(x, (bool, int, float, complex, list, tuple, np.generic)):
            try:
                arr = np.asarray(x)
            except ValueError as exc:  # ragged lists
                raise InvalidRequest(f"{what} cannot be made an array: {exc}") from None
            self.array, self.dtype = arr, _numpy_dtype(arr.dtype, what)
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
        raise InvalidType(f"{what} is a numpy masked array, which tensordepot does not store "
                          f"(the mask would be lost); pass {what}.filled(value) for its values "
                          f"with masked entries replaced, or {what}.data for its raw values")


def _numpy_dtype(dt: Any, what: str) -> str:
    try:
        return dtype_from_numpy(dt).name
    except UnsupportedDType as exc:
        raise InvalidRequest(f"{what} has dtype {dt}, which tensordepot cannot store "
                             f"({exc})") from None


def raw_view(t: SharedTensor) -> Any:
    """The tensor's bytes as a numpy array of its storage type (no ml_dtypes needed)."""
    owner = t._alive()
    return array_at(t._address, t.shape, tuple(s * t._dt.itemsize for s in t.strides),
                    t._dt.storage, writable=False, owner=owner)


def _exportable(x: Any) -> Any:
    """torch refuses to export tensors that need grad or carry lazy conj/neg bits."""
    if type(x).__module__.startswith("torch"):
        if getattr(x, "requires_grad", False):
            x = x.detach()
        if hasattr(x, "resolve_conj"):
            x = x.resolve_conj().resolve_neg()
    return x


def dtype_name(dtype: Any) -> str:
    try:
        return dtype_from_name(str(dtype)).name
    except UnsupportedDType:
        pass
    try:
        return dtype_from_numpy(dtype).name
    except (UnsupportedDType, TypeError):
        raise InvalidRequest(f"unknown dtype {shown(dtype)}; use a name such as 'float32' or "
                             f"'bfloat16', or a numpy/torch dtype") from None
