"""Worker processes driven line by line: the test writes commands to stdin
and reads answers from stdout with a deadline, so it waits on what the
worker says instead of sleeping.  stderr goes to a file, quoted on failure.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from _harness import WORKERS


class Worker:
    """``tests/workers/<script>.py`` with pipes on stdin and stdout."""

    def __init__(
        self,
        script: str,
        *args: str,
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """``launcher``: a command that runs the worker (``unshare --pid --fork``, ...)."""
        self.script = script
        # Open for the worker's whole life; close() closes it.
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*(launcher or []), sys.executable, str(WORKERS / f"{script}.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            bufsize=0,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.proc.pid
        self._buf = b""

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    def line(self, timeout: float = 30.0) -> str:
        """The next line the worker prints; fails if none comes within ``timeout`` s."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.script}: no line within {timeout} s\n{self.stderr()}")
            readable, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if readable:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    rc = self.proc.wait(timeout=10)
                    raise AssertionError(
                        f"{self.script} exited ({rc}) before answering\n{self.stderr()}"
                    )
                self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\n")
        return raw.decode()

    def read_lines(self) -> list[str] | None:
        """The complete lines that one read brings (call when select says readable); None at EOF."""
        assert self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return None
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.decode() for ln in lines]

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        got = self.line(timeout)
        assert got.startswith(prefix), (
            f"{self.script}: expected {prefix!r}, got {got!r}\n{self.stderr()}"
        )
        return got

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")

    def ask(self, command: str, prefix: str, timeout: float = 30.0) -> str:
        self.send(command)
        return self.expect(prefix, timeout)

    def kill(self) -> None:
        """SIGKILL, without reaping: until ``wait()`` the worker is a zombie."""
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._err.close()


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, T, Z, ...), or None once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def http_get(url: str, target: str) -> tuple[int, dict[str, str], str]:
    """GET ``target`` from the broker at a ``unix://`` URL, with no session:
    (status, headers with lower-case names, body)."""
    import http.client
    import socket

    path = url.removeprefix("unix://")

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(self.timeout)
            self.sock.connect(path)

    conn = _Conn("localhost", timeout=10)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        body = resp.read().decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def metrics(url: str) -> dict[str, float]:
    """The broker's Prometheus samples, by name (with labels, as written)."""
    text = http_get(url, "/metrics")[2]
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            key, _, value = ln.partition(" ")
            out[key] = float(value)
    return out
