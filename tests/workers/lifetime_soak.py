"""Soak workers: random put/put_many/get/get_many/delete (by name and by prefix)/empty
on a few shared names until a deadline, with the mishaps users cause: Ctrl-C
(SIGINT) anywhere, including in the middle of a copy, and in storms; non-contiguous
sources; fork() with views alive (half of the children never use the Client they
inherited, so their sessions are never claimed); a thread still writing while
``publish()`` runs (``race*`` names: a reader checks that the bytes it got never
change); workers that lock their memory (``mlockall``, one seed in eight); and
SharedTensors pickled before the broker restarts and unpickled after (they must
fail, never resolve to the new run's tensor of the same name and version). The
broker may be unavailable for a while (the test restarts it): calls that fail then
are counted and the worker carries on.

This process is a zygote: it imports everything once, then forks one worker
per "spawn SEED" line on stdin, so a SIGKILLed worker is replaced in
milliseconds rather than after a second of imports.  Each worker opens its
own Client after the fork.  It reaps its children and reports how each one
ended; a worker killed by the test shows up as "exit PID -9".

Every tensor describes itself, so any reader can verify any version of any
name, whoever wrote it: uint64 elements, ``[seed, n, pattern(seed, n)...]``.
A view kept across other operations is re-verified against the seed first
read from it, which catches memory that was freed and reused too early.

argv: URL DEADLINE [URL2] (time.time() at which workers stop; workers with an odd
seed use URL2 when given, a TCP listener whose sessions live on heartbeats)
stdout, one line per write (atomic below PIPE_BUF, so workers never interleave):
  "zygote ready"; "spawned PID"; "PID ready"; "PID n <k=v counters>" every few
  operations; "PID done <counters>"; "PID CORRUPT <what>" on a bad read (the
  worker then exits 3); "exit PID STATUS" (negative: killed by that signal).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections import Counter

import numpy as np
from tensordepot import BrokerUnavailable, Client, TensorBroken, TensorNotFound

NAMES = [f"soak{i}" for i in range(12)]
RACED = [f"race{i}" for i in range(2)]  # written by a publish racing a writer thread
MAX_HELD = 4
_MIX = np.uint64(0x9E3779B97F4A7C15)


def pattern(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * _MIX) ^ np.uint64(seed)


def make(seed: int, n: int) -> np.ndarray:
    out = np.empty(n + 2, np.uint64)
    out[0], out[1] = seed, n
    out[2:] = pattern(seed, n)
    return out


class Corrupt(AssertionError):
    pass


def verify(arr: np.ndarray, what: str, seed: int | None = None) -> int:
    """Check a tensor against its own header (and ``seed`` if given); return its seed."""
    if arr.dtype != np.uint64 or arr.ndim != 1 or arr.shape[0] < 2:
        raise Corrupt(f"{what}: dtype {arr.dtype}, shape {arr.shape}")
    got_seed, n = int(arr[0]), int(arr[1])
    if seed is not None and got_seed != seed:
        raise Corrupt(f"{what}: header seed changed from {seed} to {got_seed} (memory reused?)")
    if arr.shape[0] != n + 2 or not np.array_equal(arr[2:], pattern(got_seed, n)):
        raise Corrupt(f"{what}: {arr.shape[0]} elements do not match seed {got_seed}, n {n}")
    return got_seed


def size(rng: random.Random) -> int:
    # Mostly small (inline puts), some up to ~2 MiB (alloc + publish, pooled ranges).
    return rng.choice(
        [rng.randrange(0, 64), rng.randrange(64, 30_000), rng.randrange(30_000, 260_000)]
    )


def emit(text: str) -> None:
    os.write(1, f"{os.getpid()} {text}\n".encode())


def noncontiguous(arr: np.ndarray) -> np.ndarray:
    """The same values, as a strided view of a larger array."""
    wide = np.zeros((arr.shape[0], 2), dtype=arr.dtype)
    wide[:, 0] = arr
    return wide[:, 0]


def scribble(a: np.ndarray, stop: threading.Event) -> None:
    """A writer thread still writing while (and after) its tensor is published."""
    i = 0
    while not stop.is_set():
        a[i % a.shape[0]] = i
        i += 1


def race_publish(c: Client, name: str, armed: list[bool]) -> None:
    """A publish while a thread still writes.  Ctrl-C is disarmed (``armed``)
    around the thread's start, stop and join: it is for the Client's calls,
    and raised inside threading's own locks it breaks them (``Thread.start``
    then fails with "release unlocked lock"), as it would in any program."""
    out = c.empty(name, (4096,), "uint64")
    a = np.from_dlpack(out)
    a[:] = 7
    stop = threading.Event()
    th = threading.Thread(target=scribble, args=(a, stop), daemon=True)
    armed[0] = False
    th.start()
    armed[0] = True
    try:
        out.publish()
    finally:
        armed[0] = False
        stop.set()
        th.join()


def fork_and_check(c: Client, held: list[tuple[np.ndarray, int, str]], rng: random.Random) -> str:
    """fork(): the child re-verifies the views it inherited, puts and gets
    through the Client it inherited, and exits 0 (3 on a bad read)."""
    claims = rng.random() < 0.5  # or the child never touches the Client it inherited
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for view, s, what in held:
                verify(view, "forked child: " + what, s)
            if claims:
                name = f"fork{os.getpid()}"
                c.put(name, make(rng.getrandbits(63), 1000))
                verify(np.from_dlpack(c.get(name)), name)
                c.delete(name)
        except Corrupt as exc:
            emit(f"CORRUPT {exc}")
            code = 3
        except (BrokerUnavailable, TensorBroken):  # the broker restarting
            code = 0
        except BaseException:  # report anything, then leave through os._exit
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except KeyboardInterrupt:
            continue
        if got:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise Corrupt("a forked child hung")
        time.sleep(0.005)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise Corrupt(f"a forked child ended with status {status}")
    return "forks" if claims else "unclaimed_forks"


def connect(url: str, seed: int) -> Client:
    """A Client, once the broker answers (the test restarts it once)."""
    give_up = time.monotonic() + 30
    while True:
        try:
            return Client(url, label=f"soak-{seed}")
        except BrokerUnavailable:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.05)  # polled with a deadline: the broker comes back within seconds


def work(url: str, seed: int, deadline: float) -> int:
    rng = random.Random(seed)
    count: Counter[str] = Counter()
    c = connect(url, seed)
    held: list[tuple[np.ndarray, int, str]] = []  # (view, seed, what)
    raced: list[tuple[np.ndarray, np.ndarray, str]] = []  # (view, its bytes when got, what)
    pickles: list[tuple[bytes, int, str]] = []  # (a pickled SharedTensor, its seed, what)
    if seed % 8 == 3:  # a consumer that locks its memory, as inference servers do
        libc = ctypes.CDLL(None, use_errno=True)
        count["mlocked" if libc.mlockall(1 | 2) == 0 else "mlock_refused"] += 1
    emit("ready")

    def report(tag: str) -> None:
        emit(tag + " " + " ".join(f"{k}={v}" for k, v in sorted(count.items())))

    def keep(view: np.ndarray, s: int, what: str) -> None:
        """Hold ``view`` (and its lease) past this operation, to check it again later."""
        if len(held) >= MAX_HELD:
            old = held.pop(rng.randrange(len(held)))
            verify(old[0], old[2], old[1])
            count["rechecks"] += 1
        held.append((view, s, what))

    def check_held() -> None:
        for view, s, what in held:
            verify(view, what, s)
            count["rechecks"] += 1
        for view, was, what in raced:
            if not np.array_equal(view, was):
                raise Corrupt(f"{what}: published bytes changed after the get returned")
            count["rechecks"] += 1

    armed = [False]
    client_handler = signal.getsignal(signal.SIGINT)  # the Client's (shm/_sigint.py)

    def on_sigint(signum: int, frame: object) -> None:
        # Ctrl-C lands only inside an operation, where it is what the soak
        # tests; there, as the Client's handler would have it land.
        if armed[0]:
            if callable(client_handler):
                client_handler(signum, frame)
            else:
                raise KeyboardInterrupt

    def one_op(c: Client) -> Client:
        name = rng.choice(NAMES)
        op = rng.random()
        armed[0] = True
        try:
            if op < 0.06:
                # A batch, while other workers delete its names: a refused
                # publish must give back every allocation of the batch.
                batch = {nm: make(rng.getrandbits(63), size(rng)) for nm in rng.sample(NAMES, 3)}
                c.put_many(batch)
                count["batches"] += 1
            elif op < 0.25:
                n = size(rng)
                ttl = rng.uniform(0.2, 2.0) if rng.random() < 0.1 else None
                src = make(rng.getrandbits(63), n)
                if rng.random() < 0.3:
                    src = noncontiguous(src)
                    count["strided"] += 1
                c.put(name, src, ttl=ttl)
                count["puts"] += 1
            elif op < 0.35:
                n = size(rng)
                out = c.empty(name, (n + 2,), "uint64")
                np.from_dlpack(out)[...] = make(rng.getrandbits(63), n)
                if rng.random() < 0.05:
                    count["abandoned"] += 1  # never published: reclaimed when the session ends
                else:
                    try:
                        out.publish()
                        count["publishes"] += 1
                    except TensorBroken as exc:
                        # Another worker deleted the name while this one wrote
                        # it, or the broker restarted meanwhile.
                        assert isinstance(exc.__cause__, (TensorNotFound, BrokerUnavailable)), exc
                        count["misses"] += 1
                del out
            elif op < 0.70:
                t = c.get(name, timeout=0.05 if rng.random() < 0.1 else 0)
                view = np.from_dlpack(t)
                what = f"{name} v{t.version}"
                del t
                s = verify(view, what)
                count["reads"] += 1
                if rng.random() < 0.3:
                    keep(view, s, what)
                del view
            elif op < 0.75:
                got = c.get_many(rng.sample(NAMES, 2))
                for nm, t in got.items():
                    view = np.from_dlpack(t)
                    what = f"{nm} v{t.version} (get_many)"
                    s = verify(view, what)
                    count["reads"] += 1
                    if rng.random() < 0.15:
                        # A batch's view kept: with it, the lease of its pack
                        # (a put_many's small tensors), checked again later.
                        keep(view, s, what)
                        count["batch_views_kept"] += 1
                del got, t, view
            elif op < 0.87:
                if rng.random() < 0.1:
                    # soak1 deletes soak1, soak10 and soak11 in one request
                    c.delete(prefix=f"soak{rng.randrange(1, 10)}")
                    count["prefix_deletes"] += 1
                else:
                    c.delete(name)
                    count["deletes"] += 1
            elif op < 0.91:
                if rng.random() < 0.4:
                    race_publish(c, rng.choice(RACED), armed)
                    count["race_publishes"] += 1
                else:
                    nm = rng.choice(RACED)
                    t = c.get(nm)
                    view = np.from_dlpack(t)
                    del t
                    was = view.copy()
                    for _ in range(50):  # the writer may still be writing, elsewhere
                        if not np.array_equal(view[:64], was[:64]):
                            raise Corrupt(f"{nm}: published bytes changed after the get")
                    if len(raced) >= MAX_HELD:
                        raced.pop(0)
                    raced.append((view, was, nm))
                    count["race_reads"] += 1
            elif op < 0.93:
                if pickles and rng.random() < 0.5:
                    blob, s, what = pickles.pop(0)
                    try:
                        t = pickle.loads(blob)
                    except (TensorNotFound, BrokerUnavailable):
                        count["pickles_refused"] += 1  # gone, replaced, or another broker run
                    else:
                        verify(np.from_dlpack(t), "unpickled " + what, s)
                        count["pickles_read"] += 1
                        del t
                else:
                    t = c.get(name)
                    what = f"{name} v{t.version}"
                    s = verify(np.from_dlpack(t), what)
                    pickles.append((pickle.dumps(t), s, what))
                    del t
                    if len(pickles) > 8:
                        pickles.pop(0)
            elif op < 0.95:
                check_held()
            elif op < 0.985:
                for info in c.list():
                    assert info.state in ("writing", "ready") and info.readers >= 0, info
                count["lists"] += 1
            elif op < 0.995:
                count[fork_and_check(c, held, rng)] += 1
            else:
                # Close with views alive: they keep their leases; a new client carries on.
                c.close()
                c = connect(url, seed)
                count["reconnects"] += 1
        except TensorNotFound:
            count["misses"] += 1
        except (BrokerUnavailable, TensorBroken):  # the test restarts the broker once
            count["unavailable"] += 1
        except KeyboardInterrupt:  # Ctrl-C: whatever it cut short, the worker carries on
            count["interrupted"] += 1
        finally:
            armed[0] = False
        if c._closed or c._closing:  # interrupted between close() and a new Client
            c = connect(url, seed)
        count["ops"] += 1
        if count["ops"] % 5 == 0:
            report("n")
        return c

    signal.signal(signal.SIGINT, on_sigint)
    try:
        while time.time() < deadline:
            try:
                c = one_op(c)
            except KeyboardInterrupt:  # landed just outside an operation's own handler
                armed[0] = False
                count["interrupted"] += 1
        check_held()
    except Corrupt as exc:
        emit(f"CORRUPT seed={seed}: {exc}")
        return 3
    held.clear()
    c.close()
    report("done")
    return 0


def child(url: str, seed: int, deadline: float) -> None:
    """The forked worker: never returns into the zygote's loop."""
    code = 1
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)  # the zygote's command pipe is not ours to read
        os.close(fd)
        code = work(url, seed, deadline)
    except BaseException:  # report anything, then leave through os._exit
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    url, deadline = sys.argv[1], float(sys.argv[2])
    url2 = sys.argv[3] if len(sys.argv) > 3 else url
    children: set[int] = set()
    buf, eof = b"", False
    os.write(1, b"zygote ready\n")
    while not eof or children:
        readable, _, _ = select.select([] if eof else [0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 4096)
            eof = not chunk
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                cmd, seed = line.split()
                assert cmd == b"spawn", line
                pid = os.fork()
                if pid == 0:
                    child(url2 if int(seed) % 2 else url, int(seed), deadline)
                children.add(pid)
                os.write(1, f"spawned {pid}\n".encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            os.write(1, f"exit {pid} {code}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
