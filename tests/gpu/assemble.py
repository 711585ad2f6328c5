"""Lay out the ``tensordepot`` package from this tree into a directory, as
pyproject.toml's ``[tool.setuptools.package-dir]`` maps the folders, so a
machine without setuptools or network can import it:

    python3 tests/gpu/assemble.py /tmp/site      # -> /tmp/site/tensordepot/...
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def main(dest: str) -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = cfg["package-dir"]
    out = Path(dest)
    for package in cfg["packages"]:
        src = ROOT / mapping[package]
        target = out.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and (f.suffix == ".py" or f.name == "py.typed"):
                shutil.copy2(f, target / f.name)
    print(f"tensordepot from {ROOT} laid out in {out}")


if __name__ == "__main__":
    main(sys.argv[1])
