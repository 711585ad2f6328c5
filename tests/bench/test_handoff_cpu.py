"""The batch handoff CPU benchmark (tests/bench/handoff_cpu.py) keeps working.

Nothing is timed here: a few handoffs run end to end, every process gets a
CPU figure, and the broker it started leaves nothing in /dev/shm.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from _harness import TEST_PREFIX, run_bench, shm_entries


def test_handoff_cpu_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    prefix = f"{TEST_PREFIX}cpubench-{secrets.token_hex(4)}-"
    args = ["--tensors", "50", "--handoffs", "3", "--out", str(out), "--shm-prefix", prefix]
    run_bench("handoff_cpu.py", *args)
    r = json.loads(out.read_text())
    assert (r["tensors"], r["nbytes"], r["handoffs"]) == (50, 1024, 3)
    assert r["wall_ms"] > 0, r
    for who in ("broker", "producer", "consumer"):
        assert r[f"{who}_cpu_ms"] >= 0, r
    assert shm_entries(prefix) == [], "the benchmark's broker left segments"


def test_registry_cpu_benchmark_runs(tmp_path: Path) -> None:
    """``--registry``: the registry alone, in the benchmark's process; every
    lease given back, its pool's segments gone."""
    out = tmp_path / "registry.json"
    prefix = f"{TEST_PREFIX}regbench-{secrets.token_hex(4)}-"
    args = ["--registry", "--tensors", "50", "--handoffs", "3", "--reps", "2", "--out", str(out)]
    run_bench("handoff_cpu.py", *args, "--shm-prefix", prefix)
    r = json.loads(out.read_text())
    assert (r["tensors"], r["nbytes"], r["handoffs"], r["reps"]) == (50, 1024, 3, 2)
    assert len(r["samples_ms"]) == 2 and r["registry_cpu_ms"] > 0, r
    assert shm_entries(prefix) == [], "the benchmark's pool left segments"
