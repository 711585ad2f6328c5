"""Example consumer on another host: get a tensor that a producer put on a
broker elsewhere, and check it.

Its own broker (``$TENSORDEPOT_URL``) pulls the tensor from its peer over
Arrow Flight the first time any worker asks, then serves it zero copy.  It
waits up to a minute for the producer (docker/worker.py on host A).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from tensordepot import Client


def main() -> int:
    name = os.environ.get("TENSORDEPOT_EXAMPLE_NAME", "example/weights")
    want = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # what docker/worker.py puts
    with Client(label="example-consumer") as c:
        t = c.get(name, timeout=60)
        y = np.from_dlpack(t)  # zero copy: a read-only view of this host's broker memory
        ok = y.shape == want.shape and np.array_equal(y, want)
        info = {i.name: i for i in c.list()}[name]
        print(
            f"consumer: {name} v{t.version} from {info.origin} (v{info.origin_version} there): "
            f"{'ok' if ok else 'MISMATCH'}",
            flush=True,
        )
        del y, t
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
