"""report.py writes the README only when asked (--readme); peers.py runs
the cases asked for (--cases) and refuses an unknown one.

It runs from a copy of the repository's layout in a temporary folder, so a
report.py that writes the README by default changes the copy's README, never
the real one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import ROOT

README = (
    "# x\n\n## Benchmarks\n\n<!-- bench:begin -->\nTHE-OLD-TABLE\n<!-- bench:end -->\n\n## Next\n"
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for script in ("report.py", "peers.py"):  # report.py renders B10's table with peers.py
        shutil.copy(ROOT / "tests" / "bench" / script, tmp_path / "tests" / "bench")
    shutil.copy(ROOT / "docs" / "bench.json", tmp_path / "docs")  # a full run's results
    (tmp_path / "README.md").write_text(README)
    return tmp_path


def report(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "tests/bench/report.py", "docs/bench.json", "--no-plot", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res


def test_report_prints_and_leaves_the_readme_alone(repo: Path) -> None:
    res = report(repo)
    assert "| B1.copy |" in res.stdout and "report.py docs/bench.json --readme" in res.stdout
    assert (repo / "README.md").read_text() == README
    assert "README unchanged" in res.stderr


def test_report_writes_the_readme_when_asked(repo: Path) -> None:
    res = report(repo, "--readme")
    text = (repo / "README.md").read_text()
    assert "THE-OLD-TABLE" not in text and text.endswith("<!-- bench:end -->\n\n## Next\n")
    assert res.stdout.strip() in text

    other = repo / "other.md"
    other.write_text(README)
    report(repo, "--readme", str(other))
    assert "| B1.copy |" in other.read_text()


def test_a_missed_goals_cell_gives_its_latest_reason_only(repo: Path) -> None:
    results = json.loads((repo / "docs" / "bench.json").read_text())
    missed = [row for row in results["checks"] if row["pass"] is False]
    assert len(missed) >= 2, "the committed run has missed goals to show"
    a, b = missed[0], missed[1]
    a["reason"] = "NOW-A: 1.3x. Before: OLD-A-1: 1.4x. Before: OLD-A-2."
    b["reason"] = "NOW-B, measured once."
    (repo / "docs" / "bench.json").write_text(json.dumps(results))
    table = report(repo).stdout
    row_a = next(line for line in table.splitlines() if line.startswith(f"| {a['id']} |"))
    assert "NOW-A: 1.3x. (Earlier runs: `tests/bench/reasons.json`.)" in row_a
    assert "OLD-A" not in table
    row_b = next(line for line in table.splitlines() if line.startswith(f"| {b['id']} |"))
    assert row_b.endswith("| NOW-B, measured once. |")


def test_peers_runs_the_cases_asked_for_and_refuses_unknown_ones(tmp_path: Path) -> None:
    peers = [sys.executable, str(ROOT / "tests" / "bench" / "peers.py")]
    bad = subprocess.run(
        [*peers, "--cases", "4KiB,nope"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "unknown case ids ['nope']" in bad.stderr, bad.stderr
    out = tmp_path / "peers.json"
    prefix = f"tdpeers-test-{secrets.token_hex(4)}-"  # the run's own names, and only those
    res = subprocess.run(
        [
            *peers,
            "--quick",
            "--reps",
            "1",
            "--cases",
            "4KiB,gets1",
            "--systems",
            "tensordepot,shm_pipe,pipe_pickle",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TENSORDEPOT_PEERS_SHM_PREFIX": prefix},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert set(got["cases"]) == {"4KiB", "gets1"}, list(got["cases"])
    for case in got["cases"].values():
        assert set(case["systems"]) == {"tensordepot", "shm_pipe", "pipe_pickle"}
        assert all(v["median"] > 0 for v in case["systems"].values())
    made = [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
    assert made == [], f"the run left shared memory behind: {made}"


def test_a_quick_run_never_replaces_the_committed_plot(repo: Path) -> None:
    pytest.importorskip("matplotlib")
    quick = json.loads((repo / "docs" / "bench.json").read_text()) | {"mode": "quick"}
    (repo / "quick.json").write_text(json.dumps(quick))
    (repo / "docs" / "bench.png").write_bytes(b"the committed plot")
    res = subprocess.run(
        [sys.executable, "tests/bench/report.py", "quick.json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert (repo / "docs" / "bench.png").read_bytes() == b"the committed plot"
    assert (repo / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot: " in res.stderr and "quick.png" in res.stderr
