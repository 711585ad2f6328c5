"""SECURITY.md's threat model names the test that holds each line: every
test it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_threat_model_names_exists() -> None:
    text = (ROOT / "SECURITY.md").read_text()
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", text)
    assert len(named) >= 10, named
    missing = []
    for file, test in named:
        path = ROOT / "tests" / "e2e" / file
        body = ast.parse(path.read_text()).body if path.exists() else []
        names = {n.name for n in body if isinstance(n, ast.FunctionDef)}
        if test not in names:
            missing.append(f"{file}::{test}")
    assert not missing, f"SECURITY.md names tests that do not exist: {missing}"
