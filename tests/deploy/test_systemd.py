"""deploy/systemd/tensordepot.service: a hardened unit whose command line is
the real CLI's.

No systemd is needed.  The unit's ExecStart is parsed with the CLI's own
argparse parser, then run as a plain process with exactly those arguments
and the unit's Environment=; only the binary (onto this venv's
``tensordepot``) and the RuntimeDirectory (onto a temporary directory) are
mapped.  The broker must get ready, serve, and stop cleanly on the unit's
KillSignal.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _harness import ROOT, TEST_PREFIX, shm_entries, wait_for
from tensordepot import Client
from tensordepot.cli import build_parser

UNIT = ROOT / "deploy" / "systemd" / "tensordepot.service"
TENSORDEPOT = Path(sys.executable).parent / "tensordepot"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=value (repeatable), # and ; comments,
    a trailing backslash continues the line."""
    out: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"{line!r} comes before any [Section]"
        key, sep, value = line.partition("=")
        assert sep, f"not Key=value: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(service: dict[str, list[str]], key: str, default: str | None = None) -> str:
    values = service.get(key, [] if default is None else [default])
    assert len(values) == 1, f"{key}= is given {len(values)} times: {values}"
    return values[0]


def exec_start(service: dict[str, list[str]]) -> list[str]:
    argv = shlex.split(one(service, "ExecStart"))
    assert argv[0].startswith("/") and Path(argv[0]).name == "tensordepot", argv
    return argv


def runtime_dir(service: dict[str, list[str]]) -> str:
    return "/run/" + one(service, "RuntimeDirectory")


def test_unit_is_hardened(service: dict[str, list[str]]) -> None:
    assert one(service, "Type") in ("exec", "notify")
    assert one(service, "RuntimeDirectory") == "tensordepot"
    for key, want in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("ProtectHome", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("RestrictSUIDSGID", "yes"),
    ):
        assert one(service, key) == want, key
    assert one(service, "CapabilityBoundingSet") == ""  # no capabilities at all
    assert one(service, "User") not in ("", "root", "0")


def test_unit_leaves_what_the_broker_needs(service: dict[str, list[str]]) -> None:
    # The tensors live in the host's /dev/shm, shared with the workers.
    assert "/dev/shm" in " ".join(service.get("ReadWritePaths", [])).split()
    hidden = " ".join(service.get("InaccessiblePaths", []) + service.get("ReadOnlyPaths", []))
    assert "/dev" not in hidden.split() and "/dev/shm" not in hidden.split()
    # Clients refuse a broker in another IPC namespace.
    assert one(service, "PrivateIPC", "no") == "no"
    # The broker reads /proc/<pid>/stat of its clients to reclaim a dead one's leases.
    assert one(service, "ProtectProc", "default") in ("default", "noaccess", "ptraceable")
    assert one(service, "DynamicUser", "no") == "no"
    # Shutdown is graceful on SIGTERM only.
    assert one(service, "KillSignal", "SIGTERM") == "SIGTERM"
    # The socket lies in the RuntimeDirectory that systemd makes for User=.
    args = build_parser().parse_args(exec_start(service)[1:])
    assert args.listen, "ExecStart must name its socket: the default moves with $XDG_RUNTIME_DIR"
    for url in args.listen:
        assert url.startswith(f"unix://{runtime_dir(service)}/"), url


def test_exec_start_parses_with_the_real_cli(service: dict[str, list[str]]) -> None:
    argv = exec_start(service)
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.func.__name__ == "serve"


@pytest.fixture
def mapped_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="td-unit-", dir="/tmp")  # AF_UNIX paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_exec_start_runs_the_broker(service: dict[str, list[str]], mapped_dir: str) -> None:
    """Exactly the unit's command line and environment, with the binary and
    the RuntimeDirectory mapped onto this machine."""
    run = runtime_dir(service)
    argv = [str(TENSORDEPOT)] + [a.replace(run, mapped_dir) for a in exec_start(service)[1:]]
    url = build_parser().parse_args(argv[1:]).listen[0]
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
    for assignment in service.get("Environment", []):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env[key] = value.replace(run, mapped_dir)
    # What the test adds: its own segment prefix, and small pool memory.
    env |= {
        "TENSORDEPOT_SHM_PREFIX": prefix,
        "TENSORDEPOT_PREALLOC": "0",
        "TENSORDEPOT_SEGMENT_SIZE": "8MiB",
    }
    log = open(os.path.join(mapped_dir, "broker.log"), "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=mapped_dir)
    try:
        waited = subprocess.run(
            [str(TENSORDEPOT), "wait", "--url", url, "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        text = Path(log.name).read_text()
        assert waited.returncode == 0, f"{waited.stderr}\n{text}"
        assert "tensordepot ready" in text and url in text, text
        with Client(url) as c:
            c.put("w", np.arange(6.0))
            assert np.array_equal(np.from_dlpack(c.get("w")), np.arange(6.0))
            c.delete("w")
        proc.send_signal(getattr(signal, one(service, "KillSignal", "SIGTERM")))
        timeout = float(one(service, "TimeoutStopSec", "90"))
        assert proc.wait(timeout) == 0, Path(log.name).read_text()
        assert not os.path.exists(url.removeprefix("unix://"))
        wait_for(lambda: shm_entries(prefix) == [], 5, what="the broker's segments to go")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        for entry in shm_entries(prefix):
            os.unlink(os.path.join("/dev/shm", entry))


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="needs systemd-analyze (Debian/Ubuntu package systemd)",
)
def test_systemd_accepts_the_unit(service: dict[str, list[str]], mapped_dir: str) -> None:
    """systemd's own parser: unknown keys, bad values and a missing binary fail."""
    unit = Path(mapped_dir) / "tensordepot.service"
    unit.write_text(UNIT.read_text().replace(exec_start(service)[0], str(TENSORDEPOT)))
    res = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0 and "tensordepot.service" not in res.stderr, res.stderr
