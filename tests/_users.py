"""A throwaway second Unix user for the tests: created with useradd, run
through ``tests/workers/as_user.py``, deleted at the end.

Only root can do this; ``other_user()`` skips the test otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _harness import ROOT, wait_for


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int  # its own primary group
    group: str  # a second group it belongs to, for --shm-group / --allow-gid
    group_gid: int

    def _command(
        self, code: str, args: tuple[str, ...], groups: bool, env: dict[str, str] | None
    ) -> dict[str, Any]:
        """subprocess arguments that run ``code`` in as_user.py as this user."""
        supplementary = f"{self.gid},{self.group_gid}" if groups else str(self.gid)
        base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
        argv = [
            sys.executable,
            str(ROOT / "tests" / "workers" / "as_user.py"),
            str(self.uid),
            str(self.gid),
            supplementary,
            code,
            *args,
        ]
        env = {**base, "HOME": "/", "USER": self.name, **(env or {})}
        return {"args": argv, "text": True, "env": env}

    def run(
        self,
        code: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        groups: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` as this user (``groups=False``: without its second group)."""
        return subprocess.run(
            **self._command(code, args, groups, env),
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def spawn(
        self, code: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start ``code`` as this user; stdout is a pipe."""
        return subprocess.Popen(
            **self._command(code, args, True, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def emits(self, code: str, *args: str, **kw: Any) -> list[Any]:
        """``run``, require success, and return what the snippet emitted."""
        res = self.run(code, *args, **kw)
        assert res.returncode == 0, (
            f"as {self.name}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        )
        return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def _admin(*argv: str) -> None:
    # /etc/passwd is locked while another useradd runs (tests share the host): retry.
    def done() -> bool:
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
        if res.returncode != 0 and "lock" not in res.stderr:
            raise AssertionError(f"{' '.join(argv)}: {res.stderr}")
        return res.returncode == 0

    wait_for(done, 30, interval=0.2, what=" ".join(argv))


def group_dir(gid: int) -> str:
    """A socket directory the broker may use with --shm-group: ours, group ``gid``, 0750."""
    path = tempfile.mkdtemp(prefix="td-", dir="/tmp")
    os.chown(path, -1, gid)
    os.chmod(path, 0o750)
    return path


def other_user() -> Iterator[User]:
    """Create a user and a group it belongs to; remove both afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates a second Unix user with useradd")
    if not (shutil.which("useradd") and shutil.which("groupadd")):
        pytest.skip("needs useradd and groupadd to create a second Unix user")
    tag = secrets.token_hex(4)
    name, group = f"tdu{tag}", f"tdg{tag}"
    _admin("groupadd", group)
    try:
        _admin(
            "useradd",
            "--no-create-home",
            "--user-group",
            "--groups",
            group,
            "--shell",
            "/usr/sbin/nologin",
            "--home-dir",
            "/nonexistent",
            name,
        )
        try:
            import grp
            import pwd

            pw = pwd.getpwnam(name)
            yield User(name, pw.pw_uid, pw.pw_gid, group, grp.getgrnam(group).gr_gid)
        finally:
            _admin("userdel", name)
    finally:
        _admin("groupdel", group)
