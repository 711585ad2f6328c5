"""Example worker: put a tensor, read it back through a second client, check it.

It finds the broker through ``$TENSORDEPOT_URL`` (docker/compose.yaml sets
it).  The tensor stays in the broker after this process exits; see it with
``docker compose exec broker tensordepot ls``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from tensordepot import Client


def main() -> int:
    name = os.environ.get("TENSORDEPOT_EXAMPLE_NAME", "example/weights")
    # 4 MiB: goes through shared memory
    x = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    with Client(label="example-producer") as producer:
        version = producer.put(name, x)
    with Client(label="example-consumer") as consumer:
        t = consumer.get(name, timeout=10)
        y = np.from_dlpack(t)  # zero copy: a read-only view of the broker's segment
        ok = y.shape == x.shape and not y.flags.writeable and np.array_equal(x, y)
        print(
            f"worker: {name} v{version} {t.dtype}{list(t.shape)} from {consumer.url}: "
            f"{'ok' if ok else 'MISMATCH'}",
            flush=True,
        )
        del y, t
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
