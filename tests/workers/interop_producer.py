"""Interop producer: puts every dtype its library has, in both kinds, then exits.

Usage: interop_producer.py numpy|torch URL.  Prints one JSON line:
{"put": [dtype, ...], "lacks": [dtype, ...]}.
"""

from __future__ import annotations

import json
import sys

from interop_data import KINDS, raw, select, tensor_name
from tensordepot import Client
from tensordepot.shm import DTYPES


def numpy_tensor(dtype: str, kind: str) -> object | None:
    import numpy as np

    d = DTYPES[dtype]
    if d.numpy_name is not None:
        npdt = np.dtype(d.numpy_name)
    else:
        try:
            import ml_dtypes
        except ImportError:
            return None
        typ = getattr(ml_dtypes, d.ml_dtypes_name or dtype, None)
        if typ is None:
            return None
        npdt = np.dtype(typ)
    return select(raw(dtype, kind).view(npdt)[..., 0], kind)


def torch_tensor(dtype: str, kind: str) -> object | None:
    import torch

    tdt = getattr(torch, dtype, None)
    if not isinstance(tdt, torch.dtype):
        return None
    # Reinterpret the bytes in place: (..., itemsize) uint8 -> (..., 1) dtype.
    x = torch.from_numpy(raw(dtype, kind)).view(tdt)[..., 0]
    return select(x, kind)


MAKERS = {"numpy": numpy_tensor, "torch": torch_tensor}

lib, url = sys.argv[1], sys.argv[2]
make = MAKERS[lib]
put, lacks = [], []
with Client(url) as c:
    for dtype in DTYPES:
        tensors = {kind: make(dtype, kind) for kind in KINDS}
        if any(x is None for x in tensors.values()):
            lacks.append(dtype)
            continue
        for kind, x in tensors.items():
            if kind == "large":
                assert not x.is_contiguous() if lib == "torch" else not x.flags.c_contiguous  # type: ignore[attr-defined]
            c.put(tensor_name(lib, dtype, kind), x)
        put.append(dtype)
print(json.dumps({"put": put, "lacks": lacks}))
