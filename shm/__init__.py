"""Memory: POSIX shared-memory segments and pools, DLPack capsules, dtypes.

Imports neither ``tensordepot.client`` nor ``tensordepot.service``.  CUDA
support lives in ``_cuda`` and is imported lazily.
"""

from ._dlpack import FLAG_IS_COPIED as FLAG_IS_COPIED
from ._dlpack import FLAG_READ_ONLY as FLAG_READ_ONLY
from ._dlpack import Imported as Imported
from ._dlpack import export_capsule as export_capsule
from ._dlpack import import_dlpack as import_dlpack
from ._dtypes import DTYPES as DTYPES
from ._dtypes import DType as DType
from ._dtypes import UnsupportedDType as UnsupportedDType
from ._dtypes import dtype_from_dlpack as dtype_from_dlpack
from ._dtypes import dtype_from_name as dtype_from_name
from ._dtypes import dtype_from_numpy as dtype_from_numpy
from ._dtypes import numpy_dtype as numpy_dtype
from ._posix import PosixMapping as PosixMapping
from ._posix import PosixSegment as PosixSegment
from ._posix import PrefixLock as PrefixLock
from ._posix import PrefixLockError as PrefixLockError
from ._posix import array_at as array_at
from ._posix import byte_view as byte_view
from ._posix import random_name as random_name
from ._posix import sweep as sweep

__all__ = [
    "DTYPES",
    "FLAG_IS_COPIED",
    "FLAG_READ_ONLY",
    "DType",
    "Imported",
    "PosixMapping",
    "PosixSegment",
    "PrefixLock",
    "PrefixLockError",
    "UnsupportedDType",
    "array_at",
    "byte_view",
    "dtype_from_dlpack",
    "dtype_from_name",
    "dtype_from_numpy",
    "export_capsule",
    "import_dlpack",
    "numpy_dtype",
    "random_name",
    "sweep",
]
