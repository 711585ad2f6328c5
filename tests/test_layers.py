"""Dependencies flow one way, at run time too: importing a layer loads none
above it, and the client and the broker never load each other.  Each case
runs in a fresh interpreter, so that nothing this test process imported
counts.  (lint-imports checks the same of every import statement.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    pytest.param(
        "tensordepot",
        ("tensordepot.client", "tensordepot.service", "tensordepot.cli"),
        id="tensordepot",
    ),
    pytest.param(
        "tensordepot.shm",
        ("tensordepot.client", "tensordepot.service", "tensordepot.cli"),
        id="shm",
    ),
    pytest.param(
        "tensordepot.service.app", ("tensordepot.client", "tensordepot.cli"), id="service"
    ),
    pytest.param("tensordepot.client", ("tensordepot.service", "tensordepot.cli"), id="client"),
    pytest.param(
        "tensordepot.service._registry._broker",
        (
            "tensordepot.service._http",
            "tensordepot.service._hosts",
            "tensordepot.service.app",
            "tensordepot.service._auth",
        ),
        id="registry",
    ),
    pytest.param(
        "tensordepot.service._http._gate",
        ("tensordepot.service._hosts", "tensordepot.service.app"),
        id="http",
    ),
]


def loaded_after(module: str, cwd: Path) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=cwd,
    )
    names: list[str] = json.loads(res.stdout)
    return names


@pytest.mark.parametrize(("module", "above"), CASES)
def test_a_layer_loads_nothing_above_it(
    module: str, above: tuple[str, ...], tmp_path: Path
) -> None:
    names = loaded_after(module, tmp_path)
    assert module in names
    leaked = [n for n in names if any(n == a or n.startswith(a + ".") for a in above)]
    assert not leaked, f"import {module} loaded {leaked}"


def test_the_client_names_still_resolve(tmp_path: Path) -> None:
    """The other side of the lazy package: ``from tensordepot import Client`` loads the client."""
    code = (
        "import sys, tensordepot; assert 'tensordepot.client' not in sys.modules; "
        "from tensordepot import AsyncClient, Client, SharedTensor; "
        "print(Client.__module__, AsyncClient.__module__, SharedTensor.__module__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert res.stdout.split() == [
        "tensordepot.client._client",
        "tensordepot.client._async",
        "tensordepot.client._tensor",
    ]
