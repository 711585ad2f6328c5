"""A GPU worker driven over stdin, one command per line, one answer per line.

    put NAME DTYPE N SEED [DEVICE]    torch tensor on cuda:0 -> put (to DEVICE) -> "put V"
    puthost NAME DTYPE N SEED DEVICE  CPU tensor -> put(device=DEVICE)          -> "put V"
    share NAME DTYPE N SEED [WAIT]    share() a tensor this process keeps (close()
                                      waits WAIT s for readers, default 60)      -> "shared V"
    check NAME DTYPE N SEED LIB       get, import with LIB (torch, cupy, both,
                                      jax, host), compare the bits   -> "ok ..." | "bad ..."
    hold NAME                         get and keep the SharedTensor              -> "held V"
    export                            torch.from_dlpack(the held tensor) -> "ok" | "broken ..."
    longread NAME CYCLES              on a side stream: sleep CYCLES, then sum the
                                      tensor; drop it (the release goes out now) -> "queued V"
    result                            wait for the long read                     -> "sum S"
    reuse N                           let go of what it shared, fill 8 new tensors
                                      of N float32 (its allocator reuses memory) -> "reused"
    drop                              drop everything held                       -> "dropped"
    close                             Client.close()                 -> "closed S" (seconds)
    devices                           this process's GPUs                        -> "devices JSON"
    exit                                                                         -> "bye"

Prints "ready <pid>" once its Client and CUDA are up.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch
from _cuda_data import DTYPES, expected, raw
from tensordepot import Client, DepotError


def consume(t: Any, lib: str) -> list[bytes]:
    """The bytes of ``t`` as each library sees it; checks device and zero copy."""
    out = []
    if lib in ("torch", "both"):
        x = torch.from_dlpack(t)
        assert x.device.type == "cuda", x.device
        assert x.dtype == DTYPES[t.dtype], (x.dtype, t.dtype)
        out.append(raw(x))
    if lib in ("cupy", "both"):
        import cupy

        y = cupy.from_dlpack(t)
        assert y.device.id == torch.cuda.current_device()
        if lib == "both":
            assert y.data.ptr == x.data_ptr(), (
                "torch and cupy see the same device memory: zero copy"
            )
        out.append(bytes(cupy.asnumpy(y.view(f"u{y.dtype.itemsize}")).tobytes()))
    if lib == "jax":
        import jax
        import numpy as np

        z = jax.dlpack.from_dlpack(t)
        assert "cuda" in str(z.devices()).lower() or "gpu" in str(z.devices()).lower(), z.devices()
        out.append(np.asarray(z).view(f"u{z.dtype.itemsize}").tobytes())
    if lib == "host":  # a copy to host memory (numpy would refuse bfloat16: read it with torch)
        h = torch.from_dlpack(t.__dlpack__(dl_device=(1, 0), copy=True))
        assert h.device.type == "cpu"
        out.append(raw(h))
    return out


def main() -> None:
    c = Client(sys.argv[1], label="cuda-worker")
    torch.cuda.init()
    kept: list[Any] = []
    held: Any = None
    pending: Any = None
    print("ready", os.getpid(), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd in ("put", "puthost"):
                name, dtype, n, seed = args[0], args[1], int(args[2]), int(args[3])
                device = args[4] if len(args) > 4 else None
                x = expected(dtype, n, seed)
                if cmd == "put":
                    x = x.cuda()
                print("put", c.put(name, x, device=device), flush=True)
            elif cmd == "share":
                name, dtype, n, seed = args[0], args[1], int(args[2]), int(args[3])
                wait = float(args[4]) if len(args) > 4 else 60.0
                x = expected(dtype, n, seed).cuda()
                kept.append(x)
                print("shared", c.share(name, x, wait_on_close=wait), flush=True)
            elif cmd == "check":
                name, dtype, n, seed, lib = args[0], args[1], int(args[2]), int(args[3]), args[4]
                t = c.get(name, timeout=30)
                want = raw(expected(dtype, n, seed))
                got = consume(t, lib)
                bad = [i for i, b in enumerate(got) if b != want]
                print(f"ok {name} v{t.version}" if not bad else f"bad {name} {bad}", flush=True)
                del t, got
            elif cmd == "hold":
                held = c.get(args[0], timeout=30)
                print("held", held.version, flush=True)
            elif cmd == "export":
                try:
                    x = torch.from_dlpack(held)
                    torch.cuda.synchronize()
                    del x
                    print("ok", flush=True)
                except DepotError as exc:
                    print("broken", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
            elif cmd == "longread":
                name, cycles = args[0], int(args[1])
                t = c.get(name, timeout=30)
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    x = torch.from_dlpack(t)  # exported on s: the release is ordered after s
                    torch.cuda._sleep(cycles)
                    total = x.double().sum()
                version = t.version
                del t, x
                gc.collect()  # the lease ends now, with the sum still queued behind the sleep
                pending = (s, total)
                print("queued", version, flush=True)
            elif cmd == "result":
                s, total = pending
                s.synchronize()
                print("sum", float(total.item()), flush=True)
            elif cmd == "reuse":  # what a live producer does with memory it let go of
                kept.clear()
                gc.collect()
                kept.extend(torch.full((int(args[0]),), 7.0, device="cuda") for _ in range(8))
                torch.cuda.synchronize()
                print("reused", flush=True)
            elif cmd == "drop":
                held = None
                kept.clear()
                gc.collect()
                print("dropped", flush=True)
            elif cmd == "close":
                t0 = time.monotonic()
                c.close()
                print("closed", round(time.monotonic() - t0, 3), flush=True)
            elif cmd == "devices":
                from tensordepot.shm import _cuda

                print(
                    "devices",
                    json.dumps(
                        {"uuids": _cuda.local_devices().uuids, "torch": torch.cuda.device_count()}
                    ),
                    flush=True,
                )
            elif cmd == "exit":
                print("bye", flush=True)
                return
            else:
                print("unknown", cmd, flush=True)
        except Exception as exc:  # the test reads the answer
            print("error", type(exc).__name__, str(exc).replace("\n", " ")[:500], flush=True)


if __name__ == "__main__":
    main()
