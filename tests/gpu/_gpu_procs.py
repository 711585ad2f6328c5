"""Child processes of the GPU benchmarks (started with ``spawn``): each
measures its own side in a fresh interpreter, after its CUDA context and
imports are up, so only the operation under test is timed."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any


def _cuda_up() -> Any:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context exists before anything is timed
    return torch


def g1_depot(url: str, name: str, warm: int, out: Connection) -> None:
    """G1, tensordepot: get + torch.from_dlpack + read one element; the first
    (cold: the block's IPC handle is opened) and ``warm`` more."""
    torch = _cuda_up()
    from tensordepot import Client

    with Client(url) as c:
        t = c.get(name + ".tiny", timeout=30)  # session, imports, events: not what G1 measures
        x = torch.from_dlpack(t)
        x[0].item()
        del x, t
        samples = []
        for _ in range(1 + warm):
            t0 = time.perf_counter()
            t = c.get(name, timeout=30)
            x = torch.from_dlpack(t)
            x[-1].item()
            samples.append(time.perf_counter() - t0)
            del x, t
        out.send(samples)


def g1_torch(q: Any, go: Connection, out: Connection, warm: int) -> None:
    """G1, torch.multiprocessing: a CUDA tensor through a Queue, then read one
    element; the producer has queued it before the clock starts."""
    _cuda_up()
    tiny = q.get()
    tiny[0].item()
    del tiny
    samples = []
    for _ in range(1 + warm):
        out.send("ready")
        go.recv()
        t0 = time.perf_counter()
        x = q.get()
        x[-1].item()
        samples.append(time.perf_counter() - t0)
        del x
    out.send(samples)


def g3_depot(url: str, name: str, n: int, ack: Connection) -> None:
    """G3, tensordepot: wait for each new version, read it on the GPU, acknowledge."""
    torch = _cuda_up()
    from tensordepot import Client

    with Client(url) as c:
        ack.send_bytes(b"ready")
        last = 0
        for _ in range(n):
            t = c.get(name, timeout=None, newer_than=last)
            x = torch.from_dlpack(t)
            value = x[0].item()
            last = t.version
            del x, t
            ack.send_bytes(repr(float(value)).encode())


def g3_torch(q: Any, ack: Connection) -> None:
    """G3, torch.multiprocessing: receive each CUDA tensor, read it, acknowledge."""
    _cuda_up()
    ack.send_bytes(b"ready")
    while True:
        x = q.get()
        if x is None:
            return
        value = x[0].item()
        del x
        ack.send_bytes(repr(float(value)).encode())
