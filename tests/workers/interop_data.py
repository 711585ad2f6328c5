"""What interop producers and consumers agree on: names, shapes and raw bytes.

Every tensor is built from deterministic random bytes (floats include NaNs
with arbitrary payloads, so any conversion on the way shows up as a byte
difference).  Each dtype comes in two kinds:

* ``small``: C-contiguous and under the inline limit (one ``/v1/put`` call);
* ``large``: a strided view (every other column) of more than 256 KiB, so the
  producer's put reads strides and takes the alloc + publish path.
"""

from __future__ import annotations

import zlib

import numpy as np
from tensordepot.shm import DTYPES

PRODUCERS = ("numpy", "torch")
# consumer id -> what the user calls
CONSUMERS = {
    "numpy": "np.from_dlpack",
    "numpy_ml": "SharedTensor.numpy()",
    "torch": "torch.from_dlpack",
    "jax": "jax.dlpack.from_dlpack",
}
KINDS = ("small", "large")
LARGE_BYTES = 300_000  # above the 256 KiB inline limit


def full_shape(dtype: str, kind: str) -> tuple[int, ...]:
    if kind == "small":
        return (3, 5, 7)
    itemsize = DTYPES[dtype].itemsize
    rows = -(-LARGE_BYTES // (itemsize * 256))
    return (rows, 512)  # the large kind keeps every other column: (rows, 256)


def raw(dtype: str, kind: str) -> np.ndarray:
    """The bytes of the producer's full tensor, shaped ``(*full_shape, itemsize)``."""
    itemsize = DTYPES[dtype].itemsize
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{kind}".encode()))
    high = 2 if dtype == "bool" else 256  # bool bytes must be 0 or 1
    return rng.integers(0, high, size=(*full_shape(dtype, kind), itemsize), dtype=np.uint8)


def select(x: object, kind: str) -> object:
    """What the producer puts: all of a small tensor, every other column of a large one."""
    return x if kind == "small" else x[:, ::2]  # type: ignore[index]


def expected(dtype: str, kind: str) -> bytes:
    """The C-ordered bytes a consumer must see."""
    return np.ascontiguousarray(select(raw(dtype, kind), kind)).tobytes()  # type: ignore[arg-type]


def tensor_name(producer: str, dtype: str, kind: str) -> str:
    return f"{producer}.{dtype}.{kind}"
