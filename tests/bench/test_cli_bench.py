"""The CLI start-up benchmark (tests/bench/cli.py) keeps working.

Nothing is timed here: one repetition runs end to end, every command gets a
number, the goal gets a verdict, and the broker it started leaves nothing.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path

from _harness import TEST_PREFIX, run_bench, shm_entries


def test_cli_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    prefix = f"{TEST_PREFIX}clibench-{secrets.token_hex(4)}-"
    res = run_bench(
        "cli.py",
        "--reps",
        "1",
        "--out",
        str(out),
        "--shm-prefix",
        prefix,
    )
    r = json.loads(out.read_text())
    assert set(r["series"]) == {"python", "import", "help", "ls", "stat"}
    for s in r["series"].values():
        assert math.isfinite(s["median"]) and s["median"] > 0 and len(s["samples"]) == 1, s
    (check,) = r["checks"]
    assert check["id"] == "CLI.ls" and check["pass"] in (True, False)
    medians = {k: s["median"] for k, s in r["series"].items()}
    assert check["measured"] == round(medians["ls"] / medians["import"], 3)
    assert r["teardown"]["clean"], r["teardown"]
    assert shm_entries(prefix) == []
    assert "ls / import =" in res.stdout
