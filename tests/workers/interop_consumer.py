"""Interop consumer: reads every tensor the producers put, through every consumer.

Usage: interop_consumer.py URL PRODUCER...  Prints one JSON line:
{"versions": {...}, "has": {consumer: [dtype, ...]},
 "cells": {"producer-dtype-consumer": {kind: result}}}

A result records whether the import worked, whether the bytes are identical,
whether the consumer's data pointer is the broker's memory (zero copy),
whether numpy views are read-only, the consumer's error if it refused the
dtype, the error the same consumer raises for the same dtype from a native
producer (jax), and whether the broker's lease count went back to zero.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ml_dtypes
import numpy as np
import torch
from interop_data import CONSUMERS, KINDS, expected, full_shape, select, tensor_name
from tensordepot import Client
from tensordepot.shm import DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import wait_for

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = jnp = None
else:
    jax.config.update("jax_enable_x64", True)  # else jax narrows 64-bit types to 32 bits


def has_numpy(dtype: str) -> bool:
    return DTYPES[dtype].numpy_name is not None


def has_numpy_ml(dtype: str) -> bool:
    return has_numpy(dtype) or hasattr(ml_dtypes, DTYPES[dtype].ml_dtypes_name or dtype)


def has_torch(dtype: str) -> bool:
    return isinstance(getattr(torch, dtype, None), torch.dtype)


def has_jax(dtype: str) -> bool:
    return jnp is not None and hasattr(jnp, dtype)


HAS = {"numpy": has_numpy, "numpy_ml": has_numpy_ml, "torch": has_torch, "jax": has_jax}

# consumer -> (import, raw C-ordered bytes, data pointer)
IMPORT = {
    "numpy": np.from_dlpack,
    "numpy_ml": lambda t: t.numpy(),
    "torch": torch.from_dlpack,
    "jax": (lambda t: jax.dlpack.from_dlpack(t)) if jax is not None else None,
}
RAW = {
    "numpy": lambda x: x.tobytes(),
    "numpy_ml": lambda x: x.tobytes(),
    "torch": lambda x: x.contiguous().view(torch.uint8).numpy().tobytes(),
    "jax": lambda x: np.asarray(x).tobytes(),
}
POINTER = {
    "numpy": lambda x: x.ctypes.data,
    "numpy_ml": lambda x: x.ctypes.data,
    "torch": lambda x: x.data_ptr(),
    "jax": lambda x: x.unsafe_buffer_pointer(),
}


def native_error(consumer: str, dtype: str) -> list[str] | None:
    """The error ``consumer`` raises for ``dtype`` from jax, a producer of its own."""
    if jnp is None or not hasattr(jnp, dtype) or consumer not in ("numpy", "torch"):
        return None
    x = jnp.zeros((3,), dtype=getattr(jnp, dtype))
    try:
        IMPORT[consumer](x)  # type: ignore[misc]
    except Exception as exc:  # whatever the consumer raises is the result
        return [type(exc).__name__, str(exc)]
    return None


def drained(c: Client, timeout: float) -> bool:
    """Whether the broker's lease count falls to zero within ``timeout`` seconds."""
    try:
        wait_for(lambda: c.stat().leases == 0, timeout, what="the consumer's lease to be released")
    except AssertionError:
        return False
    return True


def read(c: Client, producer: str, dtype: str, kind: str, consumer: str) -> dict[str, Any]:
    res: dict[str, Any] = {
        "ok": False,
        "error": None,
        "bitexact": False,
        "zero_copy": False,
        "read_only": None,
    }
    t = c.get(tensor_name(producer, dtype, kind))
    want_shape = select(np.empty(full_shape(dtype, kind), np.uint8), kind).shape  # type: ignore[attr-defined]
    res["meta"] = t.dtype == dtype and t.shape == want_shape
    try:
        x = IMPORT[consumer](t)  # type: ignore[misc]
    except Exception as exc:  # whatever the consumer raises is the result
        res["error"] = [type(exc).__name__, str(exc)]
    else:
        res["ok"] = True
        res["bitexact"] = RAW[consumer](x) == expected(dtype, kind)
        res["zero_copy"] = POINTER[consumer](x) == t._address
        if consumer in ("numpy", "numpy_ml"):
            res["read_only"] = not x.flags.writeable
        del x
    del t
    # Reference counting frees the views at once; a view caught in a reference
    # cycle would wait for the garbage collector, which this records.
    res["drained"] = res["drained_without_gc"] = drained(c, 2)
    if not res["drained"]:
        gc.collect()
        res["drained"] = drained(c, 10)
    return res


url, producers = sys.argv[1], sys.argv[2:]
out: dict[str, Any] = {
    "versions": {
        "numpy": np.__version__,
        "torch": torch.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "jax": jax.__version__ if jax is not None else None,
    },
    "has": {cons: [d for d in DTYPES if HAS[cons](d)] for cons in CONSUMERS},
    "cells": {},
}
with Client(url) as c:
    names = {i.name for i in c.list()}
    for producer in producers:
        for dtype in DTYPES:
            if tensor_name(producer, dtype, KINDS[0]) not in names:
                continue
            for consumer in CONSUMERS:
                if IMPORT[consumer] is None:
                    continue
                cell = {kind: read(c, producer, dtype, kind, consumer) for kind in KINDS}
                if not all(cell[kind]["ok"] for kind in KINDS):
                    cell["native_error"] = native_error(consumer, dtype)  # type: ignore[assignment]
                out["cells"][f"{producer}-{dtype}-{consumer}"] = cell
print(json.dumps(out))
