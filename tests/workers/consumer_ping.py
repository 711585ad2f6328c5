"""Opens a session and reads the broker's accounting: a client that must still be served."""

from __future__ import annotations

import sys

from tensordepot import Client

with Client(sys.argv[1]) as c:
    c.stat()
print("pong", flush=True)
