"""The suite needs nothing outside the repository: a fresh clone runs green.

Nothing under ``tests/`` or ``.ci/`` may reach for a sibling folder of the
checkout (``../shared`` and the like); what the tests need ships with them.
"""

from __future__ import annotations

import re
import subprocess

from _harness import ROOT

# A path that leaves the checkout: "../shared", "/work/shared", ROOT.parent / "shared".
OUTSIDE = re.compile(r"\.\./shared|/work/shared|\.parent\s*/\s*[\"']shared[\"']")


def tracked(*folders: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p]


def test_tests_and_ci_refer_to_nothing_outside_the_repository() -> None:
    files = tracked("tests", ".ci")
    assert "tests/docker/compose-spec.json" in files, "the Compose schema must ship with the tests"
    offenders = []
    for rel in files:
        if rel == "tests/test_self_contained.py":
            continue
        try:
            text = (ROOT / rel).read_text()
        except UnicodeDecodeError:
            continue
        offenders += [
            f"{rel}:{n}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line)
        ]
    assert not offenders, "the suite reaches outside the repository:\n" + "\n".join(offenders)
