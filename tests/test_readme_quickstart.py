"""The README's first set-up command and its quick start work when followed
in order, in one shell: the set-up command must give the terminal back with
the broker running, and the quick start must then run as written.

The shell runs exactly the README's lines, but for the ``pip install -e .``
(this venv has the package) and with the broker's socket and segment prefix
set through the environment, so the test touches nobody's default broker.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _harness import ROOT, TEST_PREFIX, shm_entries, wait_for

INSTALL = "pip install -e . && "


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def setup_command(readme: str) -> str:
    first = bash_blocks(readme)[0].splitlines()[0].split("  #")[0].strip()
    assert first.startswith(INSTALL), first
    return first.removeprefix(INSTALL)


def quick_start(readme: str) -> str:
    section = readme.split("## Quick start", 1)[1]
    return bash_blocks(section)[0]


@pytest.mark.slow
def test_setup_then_quick_start_in_one_shell() -> None:
    pytest.importorskip("torch")
    readme = (ROOT / "README.md").read_text()
    sock_dir = tempfile.mkdtemp(prefix="td-readme-", dir="/tmp")  # AF_UNIX paths are short
    url = f"unix://{sock_dir}/broker.sock"
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    script = "\n".join(
        [
            "set -eu",
            setup_command(readme),
            'echo "== set-up done"',
            quick_start(readme),
            'echo "== quick start done"',
            "tensordepot rm weights",
            "kill $(jobs -p) 2>/dev/null || true",  # the brokers this shell started
            "wait || true",
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "TENSORDEPOT_LISTEN": url,
        "TENSORDEPOT_URL": url,
        "TENSORDEPOT_SHM_PREFIX": prefix,
        "TENSORDEPOT_PREALLOC": "0",
        "TENSORDEPOT_MAX_MEMORY": "1GiB",
    }
    shell = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=sock_dir,
        start_new_session=True,
    )
    try:
        out, _ = shell.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)  # the shell and any broker it left running
        out, _ = shell.communicate()
        pytest.fail(f"the README's commands did not finish (one holds the terminal?):\n{out}")
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    try:
        assert shell.returncode == 0, out
        assert "== set-up done" in out and "== quick start done" in out, out
        assert "tensor([[ 0.,  1.,  2.,  3.]," in out, out  # the consumer printed the tensor
        wait_for(lambda: shm_entries(prefix) == [], 10, what="the broker to unlink its segments")
    finally:
        for entry in shm_entries(prefix):
            os.unlink(os.path.join("/dev/shm", entry))
        for name in os.listdir(sock_dir):
            os.unlink(os.path.join(sock_dir, name))
        os.rmdir(sock_dir)
