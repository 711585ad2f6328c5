"""A reader on another host, driven line by line through stdin.

    flight_reader.py URL

Prints ``ready``, then answers each command:

    get NAME TIMEOUT   ->  ok <version> <sha256 of the bytes> <origin> <origin_version>
                           or  error <class> <message>
    many NAME,NAME     ->  ok <sha256 of the first> <sha256 of the second> ... (get_many)

The bytes are read through a zero-copy numpy view of the broker's segment,
which only a process on the broker's host can map.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
from tensordepot import Client, DepotError

with Client(sys.argv[1]) as c:
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "many":
            got = c.get_many(args[0].split(","))
            digests = [
                hashlib.sha256(np.from_dlpack(t).data.cast("B")).hexdigest() for t in got.values()
            ]
            print("ok", *digests, flush=True)
            del got
            continue
        if cmd != "get":
            break
        name, timeout = args[0], float(args[1])
        try:
            t = c.get(name, timeout=timeout)
        except DepotError as exc:
            print("error", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
            continue
        view = np.from_dlpack(t)
        digest = hashlib.sha256(view.data.cast("B")).hexdigest()
        info = {i.name: i for i in c.list()}[name]
        print("ok", t.version, digest, info.origin, info.origin_version, flush=True)
        del view, t
