"""The AsyncClient lane benchmark (tests/bench/async_lane.py) keeps working.

Nothing is timed here: a few puts and gets run on each door, each door
gets its figures, and the broker it started leaves nothing in /dev/shm.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from _harness import TEST_PREFIX, run_bench, shm_entries


def test_async_lane_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "async_lane.json"
    prefix = f"{TEST_PREFIX}alanebench-{secrets.token_hex(4)}-"
    run_bench(
        "async_lane.py", "--pairs", "20", "--rounds", "2", "--out", str(out), "--shm-prefix", prefix
    )
    r = json.loads(out.read_text())
    assert (r["pairs"], r["rounds"], r["nbytes"]) == (20, 2, 4096)
    for door in ("lane", "http"):
        for k in ("put_us", "get_us"):
            assert len(r[door][k]["samples"]) == 2 and r[door][k]["median"] > 0, r
    assert r["put_lane_over_http"] > 0 and r["get_lane_over_http"] > 0, r
    assert shm_entries(prefix) == [], "the benchmark's broker left segments"
