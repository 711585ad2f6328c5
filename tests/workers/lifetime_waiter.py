"""Lifetime worker: waits forever for a tensor that never comes, until the broker stops.

Prints "waiting" just before the get; then, when the broker shuts down, one
line "unavailable <seconds> <message>" and, for a second call made after the
broker is gone, "after <message>".  Exits 0 only if both calls raised
BrokerUnavailable.
"""

from __future__ import annotations

import sys
import time

from tensordepot import BrokerUnavailable, Client

c = Client(sys.argv[1], label="lifetime-waiter")
print("waiting", flush=True)
t0 = time.monotonic()
try:
    c.get(sys.argv[2], timeout=None)
except BrokerUnavailable as exc:
    print(f"unavailable {time.monotonic() - t0:.3f} {exc}", flush=True)
else:
    print("got a tensor that was never put", flush=True)
    sys.exit(1)
try:
    c.list()
except BrokerUnavailable as exc:
    print(f"after {exc}", flush=True)
else:
    print("list worked after the broker stopped", flush=True)
    sys.exit(1)
c.close()  # never raises, even without a broker
