"""Turn the suite's JSON into the README's table and a PNG plot.

    python tests/bench/report.py bench-results/bench.json [--readme [README.md]]
        [--plot PNG | --no-plot]

It prints the Markdown (the command, date and machine, a table with one row
per goal, the plot, and the JSON medians) and saves the plot, which needs
matplotlib (``pip install -e '.[bench]'``): a full run's to ``docs/bench.png``,
a quick run's beside its JSON (``--plot`` says where).  Only with ``--readme`` does the
Markdown also replace whatever stands between ``<!-- bench:begin -->`` and
``<!-- bench:end -->`` in the README (the repository's, unless a path is
given).  A missed goal stays in the table with its reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
ROOT = Path(__file__).resolve().parent.parent.parent


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _value(s: dict[str, Any] | None) -> str:
    if not s:
        return ""
    unit = {"x": "×"}.get(s["unit"], " " + s["unit"])
    return f"{_num(s['median'])}{unit}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


EARLIER = " Before: "  # what a reason says of earlier runs follows this (tests/bench/reasons.json)


def latest(reason: str) -> str:
    """A missed goal's reason as the table shows it: its latest measurement
    only.  The earlier ones stay in the results and in tests/bench/reasons.json."""
    now, earlier, _ = reason.partition(EARLIER)
    return f"{now} (Earlier runs: `tests/bench/reasons.json`.)" if earlier else reason


def _measured(row: dict[str, Any]) -> str:
    m = row["measured"]
    if m is None:
        return "n/a"
    return f"{_num(m)}×" if row["unit"] == "x" else f"{_num(m)} {row['unit']}"


def _goal(row: dict[str, Any]) -> str:
    if row["goal_op"] == "info":
        return "—"
    op = {">=": "≥", "<=": "≤", "<": "<"}[row["goal_op"]]
    unit = "×" if row["unit"] == "x" else f" {row['unit']}"
    return f"{op} {_num(row['goal_value'])}{unit}"


def _result(row: dict[str, Any]) -> str:
    if row["goal_op"] == "info":
        return "info"
    return {True: "pass", False: "**miss**", None: "n/a"}[row["pass"]]


def machine_line(r: dict[str, Any]) -> str:
    m, v = r["machine"], r["versions"]
    mem = f"{m['memory_bytes'] / 2**30:.0f} GiB RAM" if m.get("memory_bytes") else ""
    parts = [
        m.get("cpu_model") or "unknown CPU",
        f"{m['cpu_count']} CPUs",
        mem,
        f"Linux {m['kernel']}",
        f"Python {v['python']}",
        f"numpy {v['numpy']}",
    ]
    if v.get("torch"):
        parts.append(f"torch {v['torch']}")
    if v.get("ray"):
        parts.append(f"ray {v['ray']}")
    load = m.get("loadavg_start")
    if load:
        parts.append(f"load average {load[0]:.1f} at start")
    return ", ".join(p for p in parts if p)


def series_in(data: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every measured series (a dict with a median) in a benchmark's data, in order."""
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(data, dict):
        if "median" in data and "label" in data:
            return [(path, data)]
        for k, v in data.items():
            if not k.endswith("_raw"):
                out += series_in(v, f"{path}.{k}" if path else k)
    return out


def markdown(r: dict[str, Any], json_path: str, plot_rel: str | None) -> str:
    date = r["date"][:10]
    lines = [
        (
            f"Measured on {date} ({r['mode']} mode) with `{r['command']}`, on {machine_line(r)}. "
            f"Table and plot: `python tests/bench/report.py {json_path} --readme`."
        ),
        "",
    ]
    if r.get("note"):
        lines += [f"> {r['note']}", ""]
    lines += [
        "| | What | tensordepot (median) | Peer (median) | Measured | Goal | Result | Reason / "
        "note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first_with: dict[str, str] = {}  # a reason shared by several rows is spelled out once
    for row in r["checks"]:
        peer = row["peer"]
        peer_txt = f"{_value(peer)} ({peer['label']})" if peer else ""
        why = row["reason"] if row["pass"] is False else row.get("note", "")
        if row["pass"] is False:
            why = f"as {first_with[why]}" if why in first_with else latest(why)
            first_with.setdefault(row["reason"], row["id"])
        lines.append(
            "| "
            + " | ".join(
                _cell(x)
                for x in (
                    row["id"],
                    row["what"],
                    _value(row["ours"]),
                    peer_txt,
                    _measured(row),
                    _goal(row),
                    _result(row),
                    why,
                )
            )
            + " |"
        )
    lines.append("")
    if "B10" in r["benchmarks"]:
        import peers

        b10 = r["benchmarks"]["B10"]
        lines += [
            f"B10, against the systems users would pick instead (medians of {b10['reps']} "
            "interleaved repetitions, min to max; every consumer reads every byte; "
            "`tests/bench/peers.py`):",
            "",
            peers.table(b10),
            "",
        ]
    if plot_rel:
        lines += [f"![benchmark plot]({plot_rel})", ""]
    medians = []
    for name, data in r["benchmarks"].items():
        if name == "B10":  # its table above has every median
            continue
        parts = [f"{s['label']} {_value(s)}" for _, s in series_in(data)]
        medians.append(f"**{name}** " + "; ".join(parts))
    lines.append(f"Medians in `{json_path}` ({r['seconds']} s run): " + ". ".join(medians) + ".")
    return "\n".join(lines)


def update_readme(readme: Path, block: str) -> None:
    """Replace the text between the markers; re-read just before writing."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(
            f"{readme} has no {BEGIN} ... {END} markers; add them where the table goes"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{block}\n{END}{tail}"
    fd, tmp = tempfile.mkstemp(dir=readme.parent, prefix=".readme-")
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.chmod(tmp, readme.stat().st_mode & 0o777)
    os.replace(tmp, readme)


# -- plot ----------------------------------------------------------------------------


def _margin(row: dict[str, Any]) -> float:
    """How far a result is on the good side of its goal (>1 passes), capped at 100."""
    m, g = row["measured"], row["goal_value"]
    if row["goal_op"] == ">=":
        v = m / g if g else math.inf
    else:
        v = g / m if m > 0 else math.inf
    return min(v, 100.0)


def _bars(
    ax: Any,
    title: str,
    labels: list[str],
    values: list[float],
    unit: str,
    colors: list[str] | None = None,
) -> None:
    if not values:
        ax.set_title(f"{title}\n(not run)")
        ax.axis("off")
        return
    y = list(range(len(values)))
    ax.barh(y, values, color=colors or ["#4c72b0"] + ["#999999"] * (len(values) - 1))
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    for i, v in enumerate(values):
        ax.text(v, i, f" {_num(v)}", va="center", fontsize=8)
    ax.margins(x=0.25)


def plot(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "report.py: the plot needs matplotlib: pip install -e '.[bench]' (or pass --no-plot)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = r["benchmarks"]
    rows = [row for row in r["checks"] if row["goal_op"] != "info" and row["measured"] is not None]
    # The goals get a panel of their own across the top, a row of height for
    # each, so that every label stands clear of the next; the cases below it.
    goal_height = max(2.5, 0.22 * len(rows) + 1.0)
    fig = plt.figure(figsize=(15, goal_height + 12), layout="constrained")
    grid = fig.add_gridspec(4, 3, height_ratios=[goal_height, 4, 4, 4])
    a_goal = fig.add_subplot(grid[0, :])
    (a_b1, a_b2, a_b3), (a_b4, a_b5, a_b7), (a_b8, a_b9, a_none) = (
        [fig.add_subplot(grid[i, j]) for j in range(3)] for i in (1, 2, 3)
    )
    a_none.axis("off")

    _bars(
        a_goal,
        "Each goal: margin (>1 meets it; log scale)",
        [row["id"] for row in rows],
        [_margin(row) for row in rows],
        "measured vs goal",
        ["#55a868" if row["pass"] else "#c44e52" for row in rows],
    )
    if rows:
        a_goal.set_xscale("log")
        a_goal.axvline(1.0, color="black", lw=1)

    if "B1" in b:
        d = b["B1"]
        gb = d["nbytes"] / 1e9
        items = [("tensordepot put", d["put"])] + [
            (lbl, d[k])
            for k, lbl in (
                ("copy_2_threads", "2-thread numpy copy"),
                ("torch_fresh_share", "torch.mp fresh share"),
                ("ray_put", "ray.put"),
            )
            if "median" in d.get(k, {})
        ]
        _bars(
            a_b1,
            f"B1: put {d['put']['label'].split()[-2]} {d['put']['label'].split()[-1]}, bandwidth",
            [k for k, _ in items],
            [gb / (s["median"] / 1e3) for _, s in items],
            "GB/s (higher is better)",
        )
    else:
        _bars(a_b1, "B1", [], [], "")

    if "B2" in b:
        d = b["B2"]
        _bars(
            a_b2,
            "B2: get + read one element",
            [d["get_big"]["label"].split(", ")[-1], "1 KiB"],
            [d["get_big"]["median"], d["get_small"]["median"]],
            "ms (lower is better)",
            ["#4c72b0", "#4c72b0"],
        )
    else:
        _bars(a_b2, "B2", [], [], "")

    if "B3" in b:
        d = b["B3"]
        keys = [
            ("tensordepot", "tensordepot"),
            ("torch_fresh", "torch.mp Queue, new tensor"),
            ("torch_same_buffer", "torch.mp Queue, same buffer"),
            ("pipe", "Pipe, pickled"),
        ]
        items = [(lbl, d[k]["median"]) for k, lbl in keys if k in d]
        _bars(
            a_b3,
            "B3: 4 KiB handoff and its ack",
            [k for k, _ in items],
            [v for _, v in items],
            "ms (lower is better)",
        )
    else:
        _bars(a_b3, "B3", [], [], "")

    if "B4" in b:
        d = b["B4"]
        _bars(
            a_b4,
            f"B4: state dict, {d['tensors']} tensors",
            ["put_many + get_many", "300 singles"],
            [d["batch"]["median"], d["singles"]["median"]],
            "ms (lower is better)",
        )
    else:
        _bars(a_b4, "B4", [], [], "")

    if "B5" in b:
        d = b["B5"]
        styles = {
            "tensordepot_get": ("tensordepot get + release", "#4c72b0", "o-"),
            "tensordepot_stat": ("tensordepot stat", "#8172b2", "s--"),
            "bare_fastapi": ("bare FastAPI endpoint", "#999999", "^-"),
        }
        for key, (lbl, color, fmt) in styles.items():
            if key in d:
                xs = [int(n) for n in d[key]]
                a_b5.plot(xs, [d[key][str(n)]["median"] for n in xs], fmt, color=color, label=lbl)
        a_b5.set_xscale("log", base=2)
        a_b5.set_xticks(d["concurrency"], [str(n) for n in d["concurrency"]])
        a_b5.set_xlabel("client processes")
        a_b5.set_ylabel("ops/s (higher is better)")
        a_b5.set_ylim(bottom=0)
        a_b5.set_title("B5: control-plane operations per second", fontsize=10)
        a_b5.legend(fontsize=8)
    else:
        _bars(a_b5, "B5", [], [], "")

    pairs = (
        (
            a_b7,
            "B7",
            "B7: state dict, {tensors} tensors",
            "exchange",
            "put_many + get_many",
            "copy_2_threads",
            "2-thread copy of its bytes",
        ),
        (
            a_b8,
            "B8",
            "B8: {tensors} small tensors, process to process",
            "tensordepot",
            "put_many -> get_many -> read",
            "pipe",
            "Pipe, pickled dict",
        ),
        (
            a_b9,
            "B9",
            "B9: first put into a fresh broker",
            "cold_put",
            "cold put",
            "fresh_copy",
            "copy into fresh shm",
        ),
    )
    for ax, key, title, ours, ours_label, peer, peer_label in pairs:
        if key in b:
            d = b[key]
            _bars(
                ax,
                title.format(**d),
                [ours_label, peer_label],
                [d[ours]["median"], d[peer]["median"]],
                "ms (lower is better)",
            )
        else:
            _bars(ax, key, [], [], "")

    fig.suptitle(
        f"tensordepot benchmarks, {r['mode']} mode, {r['date'][:10]}: {machine_line(r)}", fontsize=9
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="the JSON that tests/bench/run.py wrote")
    ap.add_argument(
        "--readme",
        nargs="?",
        const=str(ROOT / "README.md"),
        default=None,
        metavar="README",
        help="also rewrite the table between the markers in README (without a path: the "
        "repository's README.md); without this flag the Markdown is only printed",
    )
    ap.add_argument(
        "--plot",
        default=None,
        help="where to save the PNG (default: docs/bench.png for a full run; beside the JSON "
        "for a quick one, so that a quick run never replaces the committed plot)",
    )
    ap.add_argument("--no-plot", action="store_true", help="no PNG (and no matplotlib needed)")
    args = ap.parse_args(argv)
    r = json.loads(Path(args.json).read_text())
    readme = Path(args.readme) if args.readme else None
    default = (
        ROOT / "docs" / "bench.png"
        if r.get("mode") == "full"
        else Path(args.json).with_suffix(".png")
    )
    png = None if args.no_plot else Path(args.plot) if args.plot else default
    if png is not None:
        plot(r, png)
    base = (readme or ROOT / "README.md").resolve().parent  # the plot's link is relative to it
    rel = os.path.relpath(png.resolve(), base) if png is not None else None
    json_shown = (
        os.path.relpath(Path(args.json).resolve(), ROOT)
        if Path(args.json).resolve().is_relative_to(ROOT)
        else args.json
    )
    block = markdown(r, json_shown, rel)
    if readme is not None:
        update_readme(readme, block)
    print(block)
    done = [f"plot: {png}"] if png is not None else []
    done.append(f"README: {readme}" if readme else "README unchanged (--readme writes it)")
    print("\n" + "; ".join(done), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
