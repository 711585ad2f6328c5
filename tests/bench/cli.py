"""The command line's start-up cost: ``tensordepot ls`` against ``import tensordepot``.

    python tests/bench/cli.py [--reps 9] [--out bench-results/cli.json]

It starts its own broker with a few tensors, then runs each command as a
fresh process, interleaved, ``--reps`` times, and writes the medians and
their ratios to JSON.  The goal: ``tensordepot ls`` (start Python, parse the
arguments, import the client, one request, print) within 2x of
``python -c "import tensordepot"``.  It is measured, not asserted: a miss
stays in the JSON with its numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _p in (str(HERE), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np
from _harness import BrokerProc
from run import machine, teardown
from tensordepot import Client, __version__

TENSORDEPOT = str(Path(sys.executable).parent / "tensordepot")
GOAL = 2.0  # ls / import


def commands(url: str) -> dict[str, tuple[str, list[str]]]:
    return {
        "python": ("python -c pass", [sys.executable, "-c", "pass"]),
        "import": ('python -c "import tensordepot"', [sys.executable, "-c", "import tensordepot"]),
        "help": ("tensordepot --help", [TENSORDEPOT, "--help"]),
        "ls": ("tensordepot ls", [TENSORDEPOT, "ls", "--url", url]),
        "stat": ("tensordepot stat", [TENSORDEPOT, "stat", "--url", url]),
    }


def measure(cmds: dict[str, tuple[str, list[str]]], reps: int, cwd: str) -> dict[str, Any]:
    samples: dict[str, list[float]] = {k: [] for k in cmds}
    order = list(cmds)
    for rep in range(reps):
        # Rotate the order, so drift on a shared machine hits every command alike.
        for key in order[rep % len(order) :] + order[: rep % len(order)]:
            t0 = time.perf_counter()
            subprocess.run(
                cmds[key][1],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                check=True,
                cwd=cwd,
                timeout=120,
            )
            samples[key].append((time.perf_counter() - t0) * 1e3)
    return {
        k: {
            "label": cmds[k][0],
            "unit": "ms",
            "median": statistics.median(v),
            "samples": [round(x, 2) for x in v],
        }
        for k, v in samples.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="runs of each command (default 9)")
    ap.add_argument("--out", default="bench-results/cli.json", help="where to write the JSON")
    ap.add_argument("--shm-prefix", help="segment prefix of the broker this run starts")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "schema": 1,
        "command": f"python tests/bench/cli.py --reps {args.reps} --out {args.out}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "tensordepot": __version__,
        },
    }
    broker = BrokerProc(prefix=args.shm_prefix or f"tdbench-cli-{secrets.token_hex(4)}-")
    try:
        names = [f"layer{i}.weight" for i in range(10)]
        with Client(broker.url) as c:
            c.put_many({name: np.zeros((64, 64), np.float32) for name in names})
        with tempfile.TemporaryDirectory() as cwd:  # away from any checkout on sys.path
            series = measure(commands(broker.url), args.reps, cwd)
        with Client(broker.url) as c:
            for name in names:
                c.delete(name)
        result["teardown"] = teardown(broker)
    finally:
        broker.cleanup()
    ratio = series["ls"]["median"] / series["import"]["median"]
    result["series"] = series
    result["checks"] = [
        {
            "id": "CLI.ls",
            "what": "tensordepot ls / python -c 'import tensordepot' (medians)",
            "measured": round(ratio, 3),
            "unit": "x",
            "goal": f"<= {GOAL:g}x",
            "pass": ratio <= GOAL,
        }
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for s in series.values():
        print(f"{s['label']:34} {s['median']:8.1f} ms (median of {args.reps})")
    verdict = "pass" if ratio <= GOAL else "miss"
    print(f"ls / import = {ratio:.2f}x (goal <= {GOAL:g}x): {verdict}; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
