"""The DCP benchmark keeps working: ``dcp.py --quick`` runs end to end, every
goal gets a measured ratio and a verdict (a miss a reason), and the broker
it started leaves nothing behind.  Performance is measured, not asserted."""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path

import pytest
from _harness import TEST_PREFIX, run_bench, shm_entries


@pytest.mark.slow
def test_dcp_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "dcp.json"
    prefix = f"{TEST_PREFIX}dbench-{secrets.token_hex(4)}-"
    res = run_bench(
        "dcp.py",
        "--quick",
        "--out",
        str(out),
        "--shm-prefix",
        prefix,
        "--disk",
        str(tmp_path),
    )
    r = json.loads(out.read_text())
    assert r["mode"] == "quick"
    assert set(r["benchmarks"]) == {
        "depot_save",
        "tmpfs_save",
        "disk_save",
        "depot_load",
        "zero_copy_load",
        "tmpfs_load",
        "disk_load",
        "cold_depot_save",
        "cold_tmpfs_save",
        "cold_depot_load",
        "cold_tmpfs_load",
    }
    for name, s in r["benchmarks"].items():
        assert s["samples"] and all(math.isfinite(x) and x > 0 for x in s["samples"]), name
    rows = {row["id"]: row for row in r["checks"]}
    assert set(rows) == {"D1", "D1'", "D2", "D2'", "D3", "D4", "D5"}
    for row in rows.values():
        assert math.isfinite(row["measured"]) and row["pass"] in (True, False, None), row
        assert row["pass"] is not False or row["reason"], row
        assert f"| {row['id']} |" in res.stdout, "the table lacks a row"
    assert r["teardown"]["clean"], r["teardown"]
    assert shm_entries(prefix) == [] and shm_entries("tdbench-dcp-") == []
