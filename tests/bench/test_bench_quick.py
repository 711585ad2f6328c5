"""The benchmark suite keeps working: its quick mode runs end to end.

Performance is measured, not asserted: these tests check that every
benchmark ran and produced numbers, that every goal has a verdict (and every
miss a reason), that the broker the suite started left nothing behind, and
that the report renders.
"""

from __future__ import annotations

import importlib.util
import json
import math
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _harness import ROOT, TEST_PREFIX, shm_entries

BENCH = ROOT / "tests" / "bench"
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# Every series each benchmark must have measured.
SERIES = {
    "B1": ["put", "copy_2_threads"] + (["torch_fresh_share"] if HAVE_TORCH else []),
    "B2": ["get_big", "get_small", "get_read_all", "kept_read_all"],
    "B3": ["tensordepot", "pipe"] + (["torch_fresh", "torch_same_buffer"] if HAVE_TORCH else []),
    "B4": ["batch", "singles", "batch_round_trips", "single_round_trips"],
    "B5": ["tensordepot_get.1", "tensordepot_get.2", "bare_fastapi.1", "bare_fastapi.2"],
    "B6": ["producer", "consumer"],
    "B7": ["exchange", "copy_2_threads", "round_trips"],
    "B8": ["tensordepot", "pipe"],
    "B9": ["cold_put", "fresh_copy", "next_two_puts"],
    "B10": [
        f"cases.{case}.systems.{system}"
        for case in ("4KiB", "8MiB", "200x1KiB", "fanout2", "gets1", "gets2")
        for system in ("tensordepot", "shm_pipe", "pipe_pickle")
        + (("torch_mp",) if HAVE_TORCH else ())
    ],
}
GOALS = [
    "B1.copy",
    "B2",
    "B2.read",
    "B3'.pipe",
    "B4.rt",
    "B4",
    "B5.1",
    "B5.2",
    "B6.producer",
    "B6.consumer",
    "B7",
    "B7.rt",
    "B8",
    "B9",
    "B10.4KiB.own",
    "B10.8MiB.own",
    "B10.200x1KiB.own",
    "B10.fanout2.own",
    "B10.gets1.own",
    "B10.gets2.own",
] + (["B1.torch", "B3", "B3'.torch"] if HAVE_TORCH else [])


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    prefix = f"{TEST_PREFIX}bench-{secrets.token_hex(4)}-"
    res = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--quick",
            "--out",
            str(out),
            "--shm-prefix",
            prefix,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 0, (
        f"quick suite failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    )
    return json.loads(out.read_text()), prefix, out


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


@pytest.mark.slow
def test_every_benchmark_has_numeric_medians(quick: tuple[dict[str, Any], str, Path]) -> None:
    r, _, _ = quick
    assert r["mode"] == "quick"
    assert set(r["benchmarks"]) == set(SERIES)
    for bench, names in SERIES.items():
        for name in names:
            s = _lookup(r["benchmarks"][bench], name)
            assert isinstance(s["median"], float) and math.isfinite(s["median"]), (bench, name, s)
            assert s["samples"] and all(math.isfinite(x) for x in s["samples"]), (bench, name)
    for key in ("cpu_count", "cpu_model", "memory_bytes"):
        assert r["machine"][key], key
    for key in ("python", "numpy"):
        assert r["versions"][key], key
    assert r["date"] and r["command"].startswith("python tests/bench/run.py --quick")


@pytest.mark.slow
def test_every_goal_has_a_verdict(quick: tuple[dict[str, Any], str, Path]) -> None:
    r, _, _ = quick
    rows = {row["id"]: row for row in r["checks"]}
    assert set(GOALS) <= set(rows), sorted(rows)
    for cid in GOALS:
        row = rows[cid]
        assert isinstance(row["measured"], (int, float)) and math.isfinite(row["measured"]), row
        assert row["pass"] in (True, False), row
        assert row["goal"], row
        if row["pass"] is False:
            assert row["reason"], f"{cid} missed without a reason"


@pytest.mark.slow
def test_broker_left_nothing(quick: tuple[dict[str, Any], str, Path]) -> None:
    r, prefix, _ = quick
    assert r["broker"]["shm_prefix"] == prefix
    assert shm_entries(prefix) == []
    assert r["teardown"]["clean"], r["teardown"]


@pytest.mark.slow
def test_report_renders(quick: tuple[dict[str, Any], str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, _, out = quick
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n## Benchmarks\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\n\n## Next\n"
    )
    png = tmp_path / "docs" / "bench.png"
    res = subprocess.run(
        [
            sys.executable,
            str(BENCH / "report.py"),
            str(out),
            "--readme",
            str(readme),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- bench:end -->\n\n## Next\n")
    assert (
        "python tests/bench/run.py --quick" in text and "![benchmark plot](docs/bench.png)" in text
    )
    for cid in GOALS:
        assert f"| {cid} |" in text, cid
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
