"""A worker that makes the mishaps users make, driven over stdin.

One command per line, one answer per line:

    empty NAME N FILL [TTL]   empty() N float32, fill with FILL through numpy, publish; keep
                              the writer's numpy and torch views             -> "ok VERSION"
    hold NAME N FILL          empty() N float32, fill, do NOT publish; keep the views  -> "ok"
    scribble NAME VALUE       write VALUE through every kept writer view of NAME         -> "ok"
    get NAME                  lease NAME, keep numpy and torch views, remember their bytes
                              -> "ok VERSION CRC"
    check NAME                are the kept views of NAME still the bytes first read?
                              -> "same" or "changed FIRST_BAD_INDEX"
    drop NAME                 drop every view of NAME                                   -> "ok"
    bigput NAME MIB           put a MIB MiB non-contiguous float32 array (the transpose of a
                              fresh one); prints "putting" first, then "done VERSION", or
                              "interrupted" after a Ctrl-C (SIGINT), and carries on
    waitget NAME              get(NAME, timeout=None); prints "waiting" first, then "got V",
                              or "interrupted" after a Ctrl-C, and carries on
    waitmany NAME,NAME        the same with get_many(NAMES, timeout=None): "got V", the
                              lowest version got
    put NAME MIB FILL         put a contiguous MIB MiB float32 array of FILL            -> "ok V"
    fork FIFO                 fork; the child puts 16 MiB (must not hang), answers
                              "child put VERSION", then runs commands read from FIFO,
                              answering on stdout with a "child " prefix, until "exit"
    leases                    the number of leases this process holds live views of  -> "n N"
    close                     close the client, views alive (they keep their leases)   -> "ok"
    exit                      leave normally
"""

from __future__ import annotations

import os
import signal
import sys
import zlib

import numpy as np
import torch
from tensordepot import Client


def crc(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


class State:
    def __init__(self, c: Client, prefix: str = "") -> None:
        self.c = c
        self.prefix = prefix
        self.writers: dict[str, list[object]] = {}
        self.readers: dict[str, tuple[list[object], bytes]] = {}

    def say(self, *words: object) -> None:
        print(self.prefix + " ".join(map(str, words)), flush=True)

    def run(self, line: str) -> bool:
        cmd, *args = line.split()
        c = self.c
        if cmd in ("empty", "hold"):
            name, n, fill = args[0], int(args[1]), float(args[2])
            ttl = float(args[3]) if len(args) > 3 else None
            t = c.empty(name, (n,), "float32", ttl=ttl)
            a = np.from_dlpack(t)
            a[:] = fill
            views = [t, a, torch.from_dlpack(t)]
            if cmd == "empty":
                t.publish()
            self.writers[name] = views
            self.say("ok", t.version)
        elif cmd == "scribble":
            value = float(args[1])
            for v in self.writers[args[0]][1:]:
                v[:] = value  # type: ignore[index]
            self.say("ok")
        elif cmd == "get":
            t = c.get(args[0], timeout=10)
            a = np.from_dlpack(t)
            self.readers[args[0]] = ([t, a, torch.from_dlpack(t)], a.tobytes())
            self.say("ok", t.version, crc(a))
        elif cmd == "check":
            views, first = self.readers[args[0]]
            want = np.frombuffer(first, dtype=np.float32)
            for v in views[1:]:
                arr = v.numpy() if isinstance(v, torch.Tensor) else v
                if arr.tobytes() != first:  # type: ignore[union-attr]
                    bad = int(np.argmax(arr != want))  # type: ignore[operator]
                    self.say("changed", bad)
                    break
            else:
                self.say("same")
        elif cmd == "drop":
            self.writers.pop(args[0], None)
            self.readers.pop(args[0], None)
            self.say("ok")
        elif cmd == "bigput":
            n = int(args[1]) << 18  # float32 elements in MIB MiB
            side = int(n**0.5)
            base = np.full((side, n // side), 5.0, dtype=np.float32)
            self.say("putting")
            try:
                v = c.put(args[0], base.T)
            except KeyboardInterrupt:
                self.say("interrupted")
            else:
                self.say("done", v)
        elif cmd in ("waitget", "waitmany"):
            self.say("waiting")
            try:
                if cmd == "waitget":
                    v = c.get(args[0], timeout=None).version
                else:
                    v = min(
                        t.version for t in c.get_many(args[0].split(","), timeout=None).values()
                    )
            except KeyboardInterrupt:
                self.say("interrupted")
            else:
                self.say("got", v)
        elif cmd == "put":
            v = c.put(args[0], np.full(int(args[1]) << 18, float(args[2]), dtype=np.float32))
            self.say("ok", v)
        elif cmd == "fork":
            self.fork(args[0])
        elif cmd == "leases":
            bg = c._bg
            self.say("n", 0 if bg is None else len(bg.live))
        elif cmd == "close":
            c.close()
            self.say("ok")
        elif cmd == "exit":
            return False
        else:
            self.say("unknown", cmd)
        return True

    def fork(self, fifo: str) -> None:
        pid = os.fork()
        if pid:
            self.say("forked", pid)
            return
        # The child: the Client it inherited must work here, and the views it
        # inherited must stay the bytes they were, whatever the parent does.
        self.prefix = "child "
        try:
            v = self.c.put("child.put", np.full(4 << 20, 3.0, dtype=np.float32))
            self.say("put", v)
            with open(fifo) as f:
                for line in f:
                    if not self.run(line):
                        break
            self.c.close()
        finally:
            os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    c = Client(sys.argv[1], label="mishap")
    s = State(c)
    print("ready", os.getpid(), flush=True)
    while True:
        # A Ctrl-C that lands once a command has answered (sent for a put
        # that had already finished) is dropped: the worker carries on.
        try:
            line = sys.stdin.readline()
            if not line or (line.strip() and not s.run(line)):
                break
        except KeyboardInterrupt:
            continue
    s.writers.clear()
    s.readers.clear()
    c.close()


if __name__ == "__main__":
    main()
