"""The benchmarks across hosts keep working: ``flight.py --quick`` runs end to end.

As for the B-suite, performance is measured, not asserted: every goal gets a
measured ratio and a verdict (a miss a reason), the brokers it started leave
nothing behind, and the README table renders.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path

import pytest
from _harness import TEST_PREFIX, run_bench, shm_entries

pytest.importorskip("pyarrow.flight")


@pytest.mark.slow
def test_flight_benchmarks_quick(tmp_path: Path) -> None:
    out = tmp_path / "flight.json"
    prefix = f"{TEST_PREFIX}fbench-{secrets.token_hex(4)}-"
    res = run_bench(
        "flight.py",
        "--quick",
        "--out",
        str(out),
        "--shm-prefix",
        prefix,
    )
    r = json.loads(out.read_text())
    assert r["mode"] == "quick" and r["versions"]["pyarrow"]
    assert set(r["benchmarks"]) == {"F1", "F2"}
    for bench, names in {"F1": ["flight_pull", "tcp"], "F2": ["one", "many"]}.items():
        for name in names:
            s = r["benchmarks"][bench][name]
            samples = s["samples"]
            assert samples and all(math.isfinite(x) and x > 0 for x in samples), (bench, name)
    rows = {row["id"]: row for row in r["checks"]}
    assert set(rows) == {"F1", "F2"}
    for row in rows.values():
        assert math.isfinite(row["measured"]) and row["pass"] in (True, False), row
        assert row["pass"] or row["reason"], row
        assert f"| {row['id']} |" in res.stdout, "the README table lacks a row"
    assert r["teardown"]["A"]["clean"] and r["teardown"]["B"]["clean"], r["teardown"]
    assert shm_entries(prefix) == []
