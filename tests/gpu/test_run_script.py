"""tests/gpu/run.sh where there is no GPU (here): it stops at its first
step, says why, and leaves summary.json; and its summary fails the tests
step when a CUDA test was skipped (on the GPU machine every one must run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "tests" / "gpu" / "summary.py"


def test_without_a_gpu_the_script_stops_first_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{tmp_path}:{os.defpath}"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "run.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 4, done
    assert "no usable GPU here: nvidia-smi finds no GPU: NVIDIA-SMI has failed" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == 4
    assert summary["steps"] == [
        {"step": "gpu", "exit": 4, "why": "nvidia-smi finds no GPU: NVIDIA-SMI has failed"}
    ]
    assert not (tmp_path / "junit.xml").exists(), "no test ran"


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2" failures="0" errors="0" skipped="{skipped}">
<testcase classname="tests.e2e.test_cuda" name="test_a"/>
<testcase classname="tests.e2e.test_cuda" name="test_b">{body}</testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize("skipped", [0, 1])
def test_a_skipped_cuda_test_fails_the_tests_step(tmp_path: Path, skipped: int) -> None:
    body = '<skipped type="pytest.skip" message="needs 2 GPUs"/>' if skipped else ""
    (tmp_path / "junit.xml").write_text(JUNIT.format(skipped=skipped, body=body))
    for step in ("gpu", "wheels"):
        assert (
            subprocess.run(
                [sys.executable, str(SUMMARY), str(tmp_path), step, "0"], check=False
            ).returncode
            == 0
        )
    rc = subprocess.run(
        [sys.executable, str(SUMMARY), str(tmp_path), "tests", "0"], check=False
    ).returncode
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["gpu", "wheels", "tests"]
    assert summary["tests"]["skipped"] == skipped
    if skipped:
        assert rc == 1 and summary["exit"] == 1
        assert summary["steps"][-1]["why"] == "1 CUDA test(s) skipped: every one must run here"
        assert summary["tests"]["skipped_tests"] == ["tests.e2e.test_cuda::test_b"]
    else:
        assert rc == 0 and summary["exit"] == 0
