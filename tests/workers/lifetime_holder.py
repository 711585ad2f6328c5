"""Lifetime worker driven over stdin: one command per line, one answer per line.

    get NAME FILL numpy|torch   lease NAME, keep a view, check every element == FILL
    many PREFIX N               get_many PREFIX0..PREFIX<N-1>, keep a view of each,
                                check every element of PREFIX<i> == i
    check                       re-check every view kept so far
    drop NAME                   drop the views of NAME (the lease ends when they are freed)
    empty NAME N                empty() N float64 elements, fill them, never publish
    close                       Client.close() while views may still be alive
    exit                        leave the process normally, views and all

It prints "ready <pid>" once connected; a test that kills it waits for that
line (or for an answer) instead of sleeping.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
from tensordepot import Client

KEPT: list[object] = []


def main() -> None:
    c = Client(sys.argv[1], label="lifetime-holder")
    views: dict[str, tuple[object, float]] = {}
    writing: list[object] = []
    print("ready", os.getpid(), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "get":
            name, fill, kind = args[0], float(args[1]), args[2]
            t = c.get(name, timeout=10)
            if kind == "torch":
                import torch

                view: object = torch.from_dlpack(t)
            else:
                view = np.from_dlpack(t)
            version = t.version
            ok = bool(np.all(np.asarray(view) == fill))
            views[name] = (view, fill)
            del t, view  # only the kept view holds the lease now
            print(f"got {name} v{version}" if ok else f"bad {name}", flush=True)
        elif cmd == "many":
            names = [f"{args[0]}{i}" for i in range(int(args[1]))]
            got = c.get_many(names, timeout=10)
            for i, n in enumerate(names):
                views[n] = (np.from_dlpack(got[n]), float(i))
            ok = all(np.all(v == fill) for v, fill in views.values())
            del got  # only the kept views hold the lease now
            print(f"got many {len(names)}" if ok else "bad many", flush=True)
        elif cmd == "check":
            bad = [n for n, (v, fill) in views.items() if not np.all(np.asarray(v) == fill)]
            print(f"ok {len(views)}" if not bad else f"bad {' '.join(bad)}", flush=True)
        elif cmd == "drop":
            del views[args[0]]
            gc.collect()
            print("dropped", args[0], flush=True)
        elif cmd == "empty":
            out = c.empty(args[0], (int(args[1]),), "float64")
            np.from_dlpack(out)[...] = 7.0
            writing.append(out)
            print("allocated", out.version, flush=True)
            del out
        elif cmd == "close":
            c.close()
            print("closed", flush=True)
        elif cmd == "exit":
            KEPT.append(views)  # alive until the interpreter is torn down, after atexit
            print("bye", flush=True)
            return
        else:
            print("unknown command", cmd, flush=True)


if __name__ == "__main__":
    main()
