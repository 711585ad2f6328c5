"""The one table of element types: names <-> DLPack (code, bits, lanes).

Every dtype that crosses the wire is named by the string in ``DTYPES``
("float32", "bfloat16", "float8_e4m3fn", ...).  The DLPack codes come from
``DLDataTypeCode`` in dlpack.h (v1.1+): bfloat16 is code 4 and the float8
family codes 7-14, so neither side needs numpy to know them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# DLDataTypeCode values (dlpack.h).
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLComplex = 5
kDLBool = 6


@dataclass(frozen=True)
class DType:
    """One element type: its name, DLPack triple and storage size."""

    name: str
    code: int
    bits: int
    lanes: int = 1
    numpy_name: str | None = None  # the numpy dtype, when numpy has one built in
    ml_dtypes_name: str | None = None  # the ml_dtypes type, for the ones numpy lacks
    itemsize: int = field(init=False)  # bytes per element (made once: every get reads it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "itemsize", self.bits * self.lanes // 8)

    @property
    def storage(self) -> str:
        """A numpy dtype of the same size, used to move the raw bytes."""
        return {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8", 16: "V16"}[self.itemsize]


def _d(name: str, code: int, bits: int, np_name: str | None = None, ml: str | None = None) -> DType:
    return DType(name, code, bits, 1, np_name, ml)


_ALL = [
    _d("bool", kDLBool, 8, "bool"),
    _d("int8", kDLInt, 8, "int8"),
    _d("int16", kDLInt, 16, "int16"),
    _d("int32", kDLInt, 32, "int32"),
    _d("int64", kDLInt, 64, "int64"),
    _d("uint8", kDLUInt, 8, "uint8"),
    _d("uint16", kDLUInt, 16, "uint16"),
    _d("uint32", kDLUInt, 32, "uint32"),
    _d("uint64", kDLUInt, 64, "uint64"),
    _d("float16", kDLFloat, 16, "float16"),
    _d("float32", kDLFloat, 32, "float32"),
    _d("float64", kDLFloat, 64, "float64"),
    _d("bfloat16", kDLBfloat, 16, ml="bfloat16"),
    _d("complex64", kDLComplex, 64, "complex64"),
    _d("complex128", kDLComplex, 128, "complex128"),
    # The float8 family, DLDataTypeCode 7..14.
    _d("float8_e3m4", 7, 8, ml="float8_e3m4"),
    _d("float8_e4m3", 8, 8, ml="float8_e4m3"),
    _d("float8_e4m3b11fnuz", 9, 8, ml="float8_e4m3b11fnuz"),
    _d("float8_e4m3fn", 10, 8, ml="float8_e4m3fn"),
    _d("float8_e4m3fnuz", 11, 8, ml="float8_e4m3fnuz"),
    _d("float8_e5m2", 12, 8, ml="float8_e5m2"),
    _d("float8_e5m2fnuz", 13, 8, ml="float8_e5m2fnuz"),
    _d("float8_e8m0fnu", 14, 8, ml="float8_e8m0fnu"),
]

DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
_BY_TRIPLE: dict[tuple[int, int, int], DType] = {(d.code, d.bits, d.lanes): d for d in _ALL}
# Common spellings users pass; they map onto the canonical names above.
_ALIASES = {
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "bf16": "bfloat16",
    "bool_": "bool",
    "cdouble": "complex128",
}
# Spellings that mean one dtype to torch and another to numpy: refused when
# bare, read as torch's when written "torch.float" (that is torch's own name).
_AMBIGUOUS = {
    "float": ("float32", "float64"),
    "int": ("int32", "int64"),
    "cfloat": ("complex64", "complex128"),
}


class UnsupportedDType(ValueError):
    """A dtype that tensordepot has no DLPack triple for."""


class AmbiguousDType(UnsupportedDType):
    """A dtype name that torch and numpy read as different dtypes."""


def dtype_from_name(name: str) -> DType:
    """Look a dtype up by name: the canonical DLPack/numpy names
    (``float32``, ``bfloat16``), ``torch.float32``-style spellings, and a few
    unambiguous aliases (``double``, ``half``, ``long``, ``bf16``).  The bare
    ``float``, ``int`` and ``cfloat`` are refused: torch and numpy read them
    as different dtypes."""
    text = str(name)
    key = text.removeprefix("torch.").removeprefix("jnp.")
    if key in _AMBIGUOUS:
        torch_means, numpy_means = _AMBIGUOUS[key]
        if text.startswith("torch."):
            return DTYPES[torch_means]
        raise AmbiguousDType(
            f"dtype {text!r} is ambiguous: torch reads it as {torch_means}, numpy as "
            f"{numpy_means}; name the one you mean, {torch_means!r} or {numpy_means!r}"
        )
    key = _ALIASES.get(key, key)
    try:
        return DTYPES[key]
    except KeyError:
        raise UnsupportedDType(
            f"unknown dtype {name!r}; use one of: {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_from_dlpack(code: int, bits: int, lanes: int) -> DType:
    """The dtype with DLPack triple (code, bits, lanes)."""
    try:
        return _BY_TRIPLE[(code, bits, lanes)]
    except KeyError:
        raise UnsupportedDType(
            f"DLPack dtype (code={code}, bits={bits}, lanes={lanes}) is not supported; "
            f"supported: {', '.join(sorted(DTYPES))}"
        ) from None


_FROM_NUMPY: dict[Any, DType] = {}  # numpy dtype object -> DType, for the dtypes seen so far


def dtype_from_numpy(dt: Any) -> DType:
    """The dtype for a numpy dtype, including ml_dtypes' bfloat16 and float8 types."""
    found = _FROM_NUMPY.get(dt) if not isinstance(dt, str) else None
    if found is not None:
        return found
    import numpy as np

    key = dt
    dt = np.dtype(dt)
    if dt.byteorder == ">":
        raise UnsupportedDType(
            f"big-endian dtype {dt} is not supported; convert with "
            f".astype('{dt.newbyteorder('<')}')"
        )
    name = dt.name
    if name in DTYPES:
        if isinstance(key, np.dtype) and len(_FROM_NUMPY) < 256:
            _FROM_NUMPY[key] = DTYPES[name]  # numpy's name property is slow; dtypes are few
        return DTYPES[name]
    raise UnsupportedDType(
        f"numpy dtype {dt} has no DLPack equivalent; supported: {', '.join(sorted(DTYPES))}"
    )


def numpy_dtype(d: DType) -> Any:
    """The numpy dtype for ``d``; bfloat16 and float8 need ml_dtypes installed."""
    import numpy as np

    if d.numpy_name is not None:
        return np.dtype(d.numpy_name)
    try:
        import ml_dtypes
    except ImportError:
        raise UnsupportedDType(
            f"numpy has no built-in {d.name}; `pip install ml_dtypes` to read it as a numpy "
            f"array, or import it with torch.from_dlpack / jax.dlpack.from_dlpack instead"
        ) from None
    try:
        return np.dtype(getattr(ml_dtypes, d.ml_dtypes_name or d.name))
    except AttributeError:
        raise UnsupportedDType(
            f"the installed ml_dtypes {ml_dtypes.__version__} lacks {d.name}; upgrade ml_dtypes"
        ) from None
