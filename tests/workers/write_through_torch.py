"""Tries to write into a published tensor through torch (which ignores DLPack's
READ_ONLY flag).  The mapping is PROT_READ, so this process must die of SIGSEGV."""

from __future__ import annotations

import sys

import torch

from tensordepot import Client

url, name = sys.argv[1], sys.argv[2]
with Client(url) as c:
    x = torch.from_dlpack(c.get(name))
    print("writing", flush=True)
    x.fill_(42.0)
    print("WROTE", flush=True)  # never reached
