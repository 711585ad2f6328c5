"""Write the README's GPU benchmark table from what tests/gpu/run.sh measured.

    python tests/gpu/report.py gpu-results/gpu-bench.json [--readme README.md]

Replaces the text between ``<!-- gpu-bench:begin -->`` and
``<!-- gpu-bench:end -->`` with the date, the device, and one row per G
figure, each marked as measured on that device.  Only figures from the
JSON are written; a benchmark that failed to run is listed as an error.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.3g} ms"


def measured(r: dict[str, Any]) -> str:
    if r["measured"] is None:
        return "—"
    return f"{r['measured']:.3g}×" if r["unit"] == "x" else f"{r['measured']:g} {r['unit']}"


def table(bench: dict[str, Any], source: str) -> str:
    m = bench["machine"]
    device = f"{m.get('gpu')} ({m.get('nvidia_smi') or 'nvidia-smi unavailable'})"
    intro = (
        f"Measured on {bench['date']} on {device}, with torch {m.get('torch')} (CUDA "
        f"{m.get('cuda')}), cupy {m.get('cupy')}, Python {m.get('python')}: `bash "
        f"tests/gpu/run.sh`, then `python tests/gpu/report.py {source}`. Every figure below "
        "was measured on that device."
    )
    lines = [
        intro,
        "",
        "| | What | tensordepot (median) | Peer (median) | Measured | Goal | Result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        verdict = {True: "pass", False: "miss", None: "info"}[r["pass"]]
        peer = f"{ms(r['peer_ms'])} ({r['peer']})" if r["peer"] else "—"
        lines.append(
            f"| {r['id']} | {r['what']} | {ms(r['tensordepot_ms'])} | {peer} | "
            f"{measured(r)} | {r['goal']} | {verdict} |"
        )
    for name, err in sorted(bench.get("errors", {}).items()):
        lines.append(f"| {name} | did not run: {err} | — | — | — | — | error |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="gpu-bench.json from tests/gpu/run.sh")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    readme = Path(args.readme)
    text = readme.read_text()
    block = f"{BEGIN}\n{table(bench, args.bench)}\n{END}"
    new, n = re.subn(
        re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL
    )
    if n != 1:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block")
    readme.write_text(new)
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
