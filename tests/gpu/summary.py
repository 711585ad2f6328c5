"""tests/gpu/run.sh's summary.json, rewritten after every step from what is
in the output folder: each step's exit status (and why, when it stopped),
the CUDA tests' counts from junit.xml, the G rows from gpu-bench.json.

    python tests/gpu/summary.py OUT STEP EXIT [WHY]

Exit status: the step's; and 1 for the tests step when a test was skipped
(on the GPU machine every CUDA test must run)."""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET
from typing import Any


def tests(out: pathlib.Path) -> Any:
    try:
        root = ET.parse(out / "junit.xml").getroot()
    except (OSError, ET.ParseError) as exc:
        return f"no junit.xml: {exc}"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "junit.xml holds no testsuite"
    counts: dict[str, Any] = {
        k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
    }
    cases = list(suite.iter("testcase"))

    def named(c: ET.Element) -> str:
        return f"{c.get('classname', '')}::{c.get('name', '')}"

    counts["failed"] = [
        named(c) for c in cases if c.find("failure") is not None or c.find("error") is not None
    ]
    counts["skipped_tests"] = [named(c) for c in cases if c.find("skipped") is not None]
    return counts


def bench(out: pathlib.Path) -> Any:
    try:
        data = json.loads((out / "gpu-bench.json").read_text())
        return {
            "rows": [
                {k: r[k] for k in ("id", "measured", "unit", "goal", "pass")} for r in data["rows"]
            ],
            "errors": data["errors"],
            "machine": data["machine"],
        }
    except (OSError, ValueError, KeyError) as exc:
        return f"no gpu-bench.json: {exc}"


def main(argv: list[str]) -> int:
    out, name, rc = pathlib.Path(argv[0]), argv[1], int(argv[2])
    why = argv[3] if len(argv) > 3 and argv[3] else None
    steps_file = out / "steps.json"
    steps = json.loads(steps_file.read_text()) if steps_file.exists() else []
    summary: dict[str, Any] = {"steps": steps}
    if (out / "junit.xml").exists():
        summary["tests"] = tests(out)
        t = summary["tests"]
        if name == "tests" and rc == 0 and isinstance(t, dict) and t["skipped"]:
            rc, why = 1, f"{t['skipped']} CUDA test(s) skipped: every one must run here"
    if (out / "gpu-bench.json").exists():
        summary["bench"] = bench(out)
    steps.append({"step": name, "exit": rc, **({"why": why} if why else {})})
    steps_file.write_text(json.dumps(steps))
    summary["exit"] = next((s["exit"] for s in steps if s["exit"]), 0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
