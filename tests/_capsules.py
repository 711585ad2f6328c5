"""Test helpers for looking inside DLPack capsules without consuming them."""

from __future__ import annotations

import ctypes
from typing import Any

from tensordepot.shm._dlpack import DLManagedTensor, DLManagedTensorVersioned

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_capsule(cap: Any, name: bytes) -> bool:
    """Whether ``cap`` is an unconsumed capsule named ``name`` (b"dltensor",
    b"dltensor_versioned")."""
    return bool(_api.PyCapsule_IsValid(cap, name))


def managed(cap: Any) -> tuple[Any, Any]:
    """(managed tensor, DLTensor) of an unconsumed capsule.

    Both point into memory the capsule owns: keep ``cap`` alive while using them."""
    if is_capsule(cap, b"dltensor_versioned"):
        mt = DLManagedTensorVersioned.from_address(
            _api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
        )
    else:
        assert is_capsule(cap, b"dltensor"), "not an unconsumed DLPack capsule"
        mt = DLManagedTensor.from_address(_api.PyCapsule_GetPointer(cap, b"dltensor"))
    return mt, mt.dl_tensor


class OneCapsule:
    """A CPU producer that hands out one given capsule, for consumers that call ``__dlpack__``."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap

    def __dlpack__(self, **kw: Any) -> Any:
        cap, self.cap = self.cap, None
        return cap

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)
