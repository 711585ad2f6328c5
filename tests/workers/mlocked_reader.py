"""A reader that locks its memory (``mlockall(MCL_CURRENT | MCL_FUTURE)``,
as latency-critical inference servers do) after its first get, driven line
by line: ``lock``, ``write NAME`` (a stray write through torch, which ignores
read-only flags, then the view dropped), ``read NAME`` (prints element 0 of
a fresh get)."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch
from tensordepot import Client

MCL_CURRENT, MCL_FUTURE = 1, 2
libc = ctypes.CDLL(None, use_errno=True)

with Client(sys.argv[1]) as c:
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, name = line.split()
        if cmd == "lock":
            if libc.mlockall(MCL_CURRENT | MCL_FUTURE):
                print("cannot", ctypes.get_errno(), flush=True)
            else:
                print("locked", flush=True)
        elif cmd == "write":
            x = torch.from_dlpack(c.get(name))
            x[0] = 4242
            del x
            print("wrote", flush=True)
        elif cmd == "read":
            t = c.get(name)
            print("read", int(np.from_dlpack(t)[0]), flush=True)
            del t
    libc.munlockall()
