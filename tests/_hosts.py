"""Other hosts, on one machine, for tests of brokers that talk across hosts.

A ``Host`` is a mount namespace with a private tmpfs on /dev/shm: a broker
and workers started in it (``nsenter``) cannot see the segments of brokers
outside it, exactly as on another machine, while the network (loopback) and
/tmp (unix sockets) stay shared.  A sleeping process holds the namespace, so
it outlives its broker and its /dev/shm can still be checked after the
broker stops (through ``/proc/<pid>/root``).

A ``Relay`` forwards TCP between a Flight client and server and can hold
the server's bytes part way through a stream: a transfer stops mid-way
deterministically, without timing.
"""

from __future__ import annotations

import functools
import os
import re
import select
import selectors
import shutil
import socket
import subprocess
import threading

from _harness import BrokerProc


@functools.lru_cache(maxsize=1)
def why_no_hosts() -> str:
    """Why mount namespaces cannot be made here, or "" if they can."""
    if os.geteuid() != 0:
        return "needs root to create mount namespaces (unshare --mount)"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux)"
    res = subprocess.run(
        ["unshare", "--mount", "--", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if res.returncode != 0:
        return f"cannot create a mount namespace with its own /dev/shm: {res.stderr.strip()}"
    return ""


class Host:
    """A mount namespace with its own /dev/shm ("another host")."""

    def __init__(self, shm_size: str = "2g") -> None:
        script = (
            f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm "
            f"&& echo ready && exec sleep infinity"
        )
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if readable else b""
        if line.strip() != b"ready":
            self.close()
            raise AssertionError(f"the namespace did not come up: {line!r}")
        self.pid = self.proc.pid
        # The command prefix that runs a process on this host.
        self.launcher = ["nsenter", f"--target={self.pid}", "--mount", "--"]
        self.shm_dir = f"/proc/{self.pid}/root/dev/shm"

    def entries(self) -> list[str]:
        return sorted(os.listdir(self.shm_dir))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def flight_url(broker: BrokerProc) -> str:
    """The Flight URL a broker serves on, from its ready line (``--flight`` port 0 picks one)."""
    m = re.search(r"flight (grpc(?:\+tls)?://[^\s,]+)", broker.log())
    assert m, f"the broker serves no Flight endpoint:\n{broker.log()}"
    return m.group(1)


class Relay:
    """Forwards TCP from ``127.0.0.1:<port>`` to ``target``.  After
    ``hold_after(n)``, bytes from the target stop flowing once ``n`` of them
    have passed, until ``release()``; ``held`` is set when that happens."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self.url = f"grpc://127.0.0.1:{self.port}"
        self.down = 0  # bytes passed from the target
        self._limit: int | None = None
        self.held = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._from_target: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def hold_after(self, nbytes: int) -> None:
        self._limit = nbytes
        self._wake_w.send(b"x")

    def release(self) -> None:
        self._limit = None
        self.held.clear()
        self._wake_w.send(b"x")

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while not self._stop:
            holding = self._limit is not None and self.down >= self._limit
            if holding:
                self.held.set()
            for s in list(self._from_target):  # reading from the target stops while holding
                want = 0 if holding else selectors.EVENT_READ
                key = sel.get_key(s) if s in sel.get_map() else None
                if want and key is None:
                    sel.register(s, want)
                elif not want and key is not None:
                    sel.unregister(s)
            for key, _ in sel.select(timeout=0.5):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                if ready is self._listen:
                    client, _ = ready.accept()
                    upstream = socket.create_connection(self.target)
                    self._pairs[client], self._pairs[upstream] = upstream, client
                    self._from_target.add(upstream)
                    sel.register(client, selectors.EVENT_READ)
                elif ready is self._wake_r:
                    ready.recv(64)
                else:
                    self._forward(sel, ready)
        sel.close()

    def _forward(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        other = self._pairs.get(s)
        if other is None:
            return
        room = 1 << 16
        if s in self._from_target and self._limit is not None:
            room = max(1, min(room, self._limit - self.down))
        try:
            data = s.recv(room)
        except OSError:
            data = b""
        if data:
            try:
                other.sendall(data)
            except OSError:
                data = b""
            else:
                if s in self._from_target:
                    self.down += len(data)
                return
        for sock in (s, other):  # one side closed: close both, as a dropped connection
            if sock in sel.get_map():
                sel.unregister(sock)
            self._pairs.pop(sock, None)
            self._from_target.discard(sock)
            sock.close()

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        for s in list(self._pairs):
            s.close()
        for s in (self._listen, self._wake_r, self._wake_w):
            s.close()
