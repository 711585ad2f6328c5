"""An editable install, used from the folder that holds a clone named ``tensordepot``.

The package is assembled from several folders (``common/`` is ``tensordepot``),
so setuptools' default editable install maps it with an import hook that
runs after Python's path search.  Python puts the current folder first on
``sys.path``, so from the clone's parent folder the clone itself is found
first, as an empty namespace package.  The README documents the symptom and
the remedies; these tests hold it to them, in a venv of their own that sees
this venv's dependencies but not its install of tensordepot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from _harness import ROOT

IMPORT = "from tensordepot import Client; print(Client.__module__)"
SYMPTOM = "cannot import name 'Client' from 'tensordepot' (unknown location)"


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a copy of this checkout named ``tensordepot``, and a venv."""
    top = tmp_path_factory.mktemp("clone-parent")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for rel in files.stdout.decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            dest = top / "tensordepot" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes((ROOT / rel).read_bytes())
    venv.EnvBuilder(with_pip=False).create(top / "venv")
    python = top / "venv" / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run(
        [python, "-c", purelib], capture_output=True, text=True, check=True
    ).stdout.strip()
    # The dependencies come from this venv.  A path added by a .pth file has its
    # own .pth files ignored, so this venv's editable tensordepot stays out.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return top


def install(parent: Path, *config: str) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(parent / "venv" / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(parent / "tensordepot"),
            *config,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr


def run(
    parent: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(parent / "venv" / "bin" / "python"), *args],
        cwd=parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


@pytest.mark.slow
def test_readme_describes_the_shadowing_and_its_remedies(parent: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    for words in (SYMPTOM, "PYTHONSAFEPATH=1", "--config-settings editable_mode=strict"):
        assert words in readme, words

    install(parent)  # the default (lenient) editable install
    res = run(parent, "-c", IMPORT)
    assert res.returncode == 1 and SYMPTOM in res.stderr, res.stderr  # what the README shows
    for cwd in (parent / "tensordepot", parent / "venv"):  # any other folder works
        ok = subprocess.run(
            [str(parent / "venv" / "bin" / "python"), "-c", IMPORT],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ok.returncode == 0, ok.stderr
    console = subprocess.run(
        [str(parent / "venv" / "bin" / "tensordepot"), "--version"],
        cwd=parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert console.returncode == 0, console.stderr  # the command never looks in the cwd
    if sys.version_info >= (3, 11):
        safe = run(parent, "-c", IMPORT, env={**os.environ, "PYTHONSAFEPATH": "1"})
        assert safe.returncode == 0, safe.stderr
        assert safe.stdout.strip() == "tensordepot.client._client"

    install(parent, "--config-settings", "editable_mode=strict")
    res = run(parent, "-c", IMPORT)
    assert res.returncode == 0 and res.stdout.strip() == "tensordepot.client._client", res.stderr
