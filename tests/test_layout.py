"""The shape of the house: product modules a reader takes in at once, and
every route handled once.

A product module over ``MAX_LINES`` lines must say why in its docstring
(the words "over 600 lines"), so that a long file is a decision, not drift.

Lines are counted as ``ruff format`` lays them out: one argument per line
wherever a call does not fit, which adds 13% to the product code as a whole
(36% to the densest module) without adding anything to read.  600 formatted
lines hold what 500 hand-wrapped ones did before the formatter ran.
"""

from __future__ import annotations

import ast
import subprocess

from _harness import ROOT

MAX_LINES = 600
PRODUCT = ("common", "client", "service", "shm", "cli", "checkpoint")


def _modules() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *PRODUCT], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p.endswith(".py")]


def test_no_product_module_is_over_600_lines_without_saying_why() -> None:
    files = _modules()
    assert len(files) > 30
    long = []
    for rel in files:
        text = (ROOT / rel).read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and f"over {MAX_LINES} lines" not in doc:
            long.append(f"{rel}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines that do not say why: {long}"


def test_every_route_has_one_handler_and_the_lane_has_none() -> None:
    """Handlers live in service/_http/routers/ and nowhere else: the doors and the
    gate dispatch through the route table, never by path."""
    from tensordepot.service._http._routes import ROUTES

    handlers = [r.handler for r in ROUTES if r.handler is not None]
    assert len(handlers) == len(set(handlers)), "one handler serves one route"
    for h in handlers:
        assert h.__module__.startswith("tensordepot.service._http.routers."), h
    for door in ("service/_http/_lane.py", "service/_http/_asgi.py", "service/_http/_gate.py"):
        text = (ROOT / door).read_text()
        assert "/v1/" not in text.replace("service/_", ""), f"{door} names a route's path"
