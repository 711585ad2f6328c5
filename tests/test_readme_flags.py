"""The README names only flags the real CLI takes, and says what the compose
files need before they run."""

from __future__ import annotations

import re
import subprocess
import sys

from _harness import ROOT

README = (ROOT / "README.md").read_text()
COMMANDS = ("serve", "ls", "stat", "rm", "wait", "load", "save", "push")


def cli_flags() -> set[str]:
    flags: set[str] = set()
    for cmd in COMMANDS:
        out = subprocess.run(
            [sys.executable, "-m", "tensordepot", cmd, "--help"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        flags |= set(re.findall(r"--[a-z][a-z0-9-]*", out))
    return flags


def _family(flag: str) -> str:
    words = flag[2:].split("-")
    return words[1] if words[0] == "no" and len(words) > 1 else words[0]


def test_every_broker_flag_the_readme_names_exists() -> None:
    flags = cli_flags()
    # Flags of other tools (pip, docker, useradd, the benchmarks) share no
    # first word with the CLI's (the word after "no-" for a --no-... flag):
    # only the CLI's families are checked.
    families = {_family(f) for f in flags}
    named = {f for f in re.findall(r"--[a-z][a-z0-9-]*", README) if _family(f) in families}
    assert named - flags == set(), "the README names flags that tensordepot does not take"


def test_the_readme_says_which_compose_files_need_a_token() -> None:
    for name in ("compose.tcp.yaml", "compose.hosts.yaml"):
        text = (ROOT / "docker" / name).read_text()
        assert "${TENSORDEPOT_TOKEN:?" in text, f"{name} runs without a token"
        lines = [ln for ln in README.splitlines() if f"docker/{name} up" in ln]
        assert lines and all("$TENSORDEPOT_TOKEN" in ln for ln in lines), (name, lines)
