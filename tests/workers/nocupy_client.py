"""Every CPU path of the client in a process where ``import cupy`` fails
(run with tests/workers/nocupy on PYTHONPATH).  Prints "ok" at the end."""

from __future__ import annotations

import sys

import numpy as np
from tensordepot import Client, InvalidRequest

try:
    import cupy  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("cupy is importable: the blocker is not active")


def refused(fn: object, match: str) -> None:
    try:
        fn()  # type: ignore[operator]
    except InvalidRequest as exc:
        assert match in str(exc), f"{match!r} not in {exc}"
    else:
        raise AssertionError(f"{fn} was not refused")


with Client(sys.argv[1]) as c:
    small = np.arange(10, dtype=np.float32)
    c.put("small", small)
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: allocated, copied, published
    c.put("big", big, device="cpu")
    t = c.get("big")
    assert t.device == "cpu" and np.array_equal(np.from_dlpack(t), big)
    c.put("alias", t)  # shares the bytes
    out = c.empty("filled", (4, 4), "float64", device="cpu:0")
    np.from_dlpack(out)[...] = 7.0
    out.publish()
    c.put_many({"sd.w": np.ones((8, 8), dtype=np.float16), "sd.b": np.zeros(8, dtype=np.int64)})
    sd = c.get_many(["sd.w", "sd.b", "small", "filled"])
    assert np.array_equal(np.from_dlpack(sd["small"]), small)
    assert float(np.from_dlpack(sd["filled"]).sum()) == 7.0 * 16
    refused(lambda: c.put("gpu", small, device="cuda"), "cupy")
    refused(lambda: c.empty("gpu", (4,), "float32", device="cuda:0"), "cupy")
    refused(lambda: c.put("gpu", small, device="tpu"), "cuda:N")
    refused(lambda: c.share("gpu", small), "not on a GPU")
    assert c.stat().devices == [], "no GPU was touched"
    assert {i.device for i in c.list()} == {"cpu"}
    del t, out, sd
    for info in c.list():
        c.delete(info.name)
assert not [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx", "cupy_backends")]
print("ok")
