"""A process without ml_dtypes: torch puts and reads bfloat16 and float8; numpy cannot.

Usage: interop_noml.py URL.  ml_dtypes is hidden before anything is imported
(``sys.modules['ml_dtypes'] = None`` makes ``import ml_dtypes`` raise
ImportError), as on a machine where it is not installed.  Prints one JSON line.
"""

from __future__ import annotations

import sys

sys.modules["ml_dtypes"] = None  # type: ignore[assignment]

import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from interop_data import expected, raw
from tensordepot import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import wait_for


def error_of(fn: Any) -> list[str] | None:
    try:
        fn()
    except Exception as exc:  # the error is the result
        return [type(exc).__name__, str(exc)]
    return None


url = sys.argv[1]
out: dict[str, Any] = {"ml_dtypes_hidden": error_of(lambda: __import__("ml_dtypes")) is not None}
with Client(url) as c:
    for dtype in ("bfloat16", "float8_e4m3fn"):
        x = torch.from_numpy(raw(dtype, "small")).view(getattr(torch, dtype))[..., 0]
        c.put(f"noml.{dtype}", x)
        t = c.get(f"noml.{dtype}")
        y = torch.from_dlpack(t)
        res = {
            "torch_bitexact": (
                y.contiguous().view(torch.uint8).numpy().tobytes() == expected(dtype, "small")
            ),
            "numpy_method": error_of(t.numpy),
            "np_from_dlpack": error_of(partial(np.from_dlpack, t)),
            "np_native": error_of(partial(np.from_dlpack, x)),  # numpy on torch's own tensor
        }
        del t, y
        res["drained"] = bool(wait_for(lambda: c.stat().leases == 0, 10, what="leases to drain"))
        out[dtype] = res
    c.put("noml.float32", np.arange(6, dtype=np.float32))
    out["float32_numpy"] = c.get("noml.float32").numpy().tolist()
print(json.dumps(out))
