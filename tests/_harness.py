"""Test harness: real ``tensordepot serve`` processes and worker processes.

Every broker started here gets its own socket and segment prefix.  On
teardown the fixture checks that the broker's accounting is clean (no
sessions, no leases, and no bytes once the remaining names are deleted),
stops it with SIGTERM, and checks that /dev/shm holds nothing of it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensordepot import Client, Stat

if TYPE_CHECKING:
    from tensordepot.service import Broker

# Per test run: engineers and CI jobs that share a host (and /dev/shm) run the
# suite at the same time, and each run checks and sweeps only its own segments.
# The workers of one parallel run (pytest -n) share the run's prefix: the
# controller names it (tests/conftest.py) and they inherit it.
RUN_VAR = "TDTEST_RUN"
_WORKER = "PYTEST_XDIST_WORKER" in os.environ and os.environ.get(RUN_VAR)
RUN_ID = os.environ[RUN_VAR] if _WORKER else str(os.getpid())
TEST_PREFIX = f"tdtest-{RUN_ID}-"
ROOT = Path(__file__).resolve().parent.parent


def in_pid_namespace() -> list[str] | None:
    """The launcher that runs a process in a pid namespace of its own
    (``unshare``), or None where this cannot be done (not root, no unshare):
    from the other side of it, the kernel reports its peer's pid as 0."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    ok = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    return ["unshare", "--pid", "--fork", "--mount-proc"] if ok.returncode == 0 else None


def wait_for(
    cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or cond} (last: {last!r})")


def stat_when(c: Any, pred: Callable[[Any], Any], what: str, timeout: float = 10.0) -> Any:
    """The broker's ``Stat`` (through client ``c``) once ``pred`` holds for it;
    fails after ``timeout`` seconds, saying ``what`` it waited for."""

    def check() -> Any:
        st = c.stat()
        return st if pred(st) else None

    return wait_for(check, timeout, what=what)


def drained(source: Any, *fields: str, sessions: int | None = None, timeout: float = 10.0) -> Any:
    """The ``Stat`` of ``source`` (a client or a ``BrokerProc``) once each of
    ``fields`` is 0, and ``sessions`` (if given) is that many: releases go in
    the background, so this polls."""
    said = [f"{f} 0" for f in fields] + [f"{sessions} sessions"] * (sessions is not None)
    want = " and ".join(said)
    return stat_when(
        source,
        lambda st: (
            all(getattr(st, f) == 0 for f in fields)
            and (sessions is None or st.sessions == sessions)
        ),
        want,
        timeout,
    )


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``tests/bench/<script>`` with ``args`` in a process of its own, from
    the repository root; fail with its output if it fails."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    return res


def file_position(ptr: int) -> tuple[str, int]:
    """(file, offset in it) of the memory at ``ptr`` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return (parts[5] if len(parts) > 5 else ""), int(parts[2], 16) + ptr - lo
    raise AssertionError(f"{ptr:#x} is in no mapping")


def in_segment(address: int, prefix: str) -> bool:
    """Whether ``address`` lies in a mapping of one of the broker's segments
    (/dev/shm/<prefix>...): zero copy, not a copy of it."""
    try:
        return file_position(address)[0].startswith(f"/dev/shm/{prefix}")
    except AssertionError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_once(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tensordepot serve`` with only these settings, for one that must refuse to start."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
    return subprocess.run(
        [sys.executable, "-m", "tensordepot", "serve", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def shm_entries(prefix: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Names under ``shm_dir`` that start with ``prefix`` (none once a namespace's /dev/shm is
    gone)."""
    try:
        return sorted(e for e in os.listdir(shm_dir) if e.startswith(prefix))
    except FileNotFoundError:
        return []


def in_process_broker(tag: str) -> Iterator[Broker]:
    """A fixture's broker of this process, on its own segments (8 MiB, 1 MiB
    each): none is left once it closes."""
    from tensordepot.service import Broker
    from tensordepot.shm._pool import Pool

    prefix = f"{TEST_PREFIX}{tag}-{secrets.token_hex(4)}-"
    b = Broker(Pool(prefix, max_memory=8 << 20, segment_size=1 << 20, prefault=False))
    yield b
    b.close()
    assert shm_entries(prefix) == []


class BrokerProc:
    """A running ``tensordepot serve`` process."""

    def __init__(
        self,
        *args: str,
        max_memory: str = "2GiB",
        env: dict[str, str] | None = None,
        prefix: str | None = None,
        sock_dir: str | None = None,
        launcher: list[str] | None = None,
        shm_dir: str = "/dev/shm",
    ) -> None:
        self.dir = sock_dir or tempfile.mkdtemp(prefix="td-", dir="/tmp")  # AF_UNIX paths are short
        self.sock = os.path.join(self.dir, "broker.sock")
        self.url = "unix://" + self.sock
        self.prefix = prefix or f"{TEST_PREFIX}{secrets.token_hex(4)}-"
        self.args = [
            "--listen",
            self.url,
            "--shm-prefix",
            self.prefix,
            "--max-memory",
            max_memory,
            "--prealloc",
            "0",
            "--reap-interval",
            "0.1",
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.log_path = os.path.join(self.dir, "broker.log")
        self.launcher = launcher or []  # runs the broker elsewhere, e.g. in another mount namespace
        self.shm_dir = shm_dir  # where its segments are seen from here
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        start = self._log.tell()  # a restart on the same dir appends: only new lines count
        argv = [*self.launcher, sys.executable, "-m", "tensordepot", "serve", *self.args]
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise AssertionError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            with open(self.log_path, "rb") as f:
                f.seek(start)
                if b"tensordepot ready" in f.read():
                    return
            time.sleep(0.02)
        raise AssertionError(f"broker not ready within 30 s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kw: Any) -> Client:
        return Client(self.url, **kw)

    def stat(self) -> Stat:
        with self.client() as c:
            return c.stat()

    def segments(self) -> list[str]:
        return shm_entries(self.prefix, self.shm_dir)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def check_clean(self) -> None:
        """Accounting: no sessions or leases; no bytes once every name is deleted."""

        def idle() -> Stat | None:
            st = self.stat()
            return st if st.sessions <= 1 and st.leases == 0 else None  # <=1: our own probe

        wait_for(idle, 10, what="sessions and leases to drain")
        with self.client() as c:
            for info in c.list():
                c.delete(info.name)
            st = c.stat()
        assert st.bytes_in_use == 0, st
        assert st.versions == 0, st

    def cleanup(self) -> None:
        if self.alive:
            self.stop(signal.SIGKILL)
        for entry in self.segments():
            os.unlink(os.path.join(self.shm_dir, entry))
        shutil.rmtree(self.dir, ignore_errors=True)


def run_worker(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/workers/<script>.py`` as a separate process and require success."""
    path = ROOT / "tests" / "workers" / f"{script}.py"
    res = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert res.returncode == 0, (
        f"worker {script} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    )
    return res


def spawn_worker(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    path = ROOT / "tests" / "workers" / f"{script}.py"
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


WORKERS = ROOT / "tests" / "workers"


# The console script pip installed next to this interpreter: `tensordepot`.
TENSORDEPOT = str(Path(sys.executable).parent / "tensordepot")


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run the real ``tensordepot`` with no TENSORDEPOT_* variables but ``env``'s."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    res: subprocess.CompletedProcess[str] = subprocess.run(
        [TENSORDEPOT, *args],
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        check=False,
        **kw,
    )
    return res


def ok(*args: str, **kw: Any) -> str:
    res = cli(*args, **kw)
    assert res.returncode == 0, f"tensordepot {' '.join(args)} -> {res.returncode}\n{res.stderr}"
    assert res.stderr == "", res.stderr
    return res.stdout
