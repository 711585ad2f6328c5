"""DCP checkpoints: D1 save and D2, D3 load through the broker against
torch's own FileSystemWriter and FileSystemReader, in one run.

    python tests/bench/dcp.py [--quick] [--out bench-results/dcp.json]
    python tests/bench/dcp.py --report docs/dcp-bench.json   # the README's table

One process saves and loads a state dict of 1 GiB (64 float32 tensors of
16 MiB; ``--quick``: 64 MiB, for CI) with ``torch.distributed.checkpoint``:

* **D1.** ``dcp.save`` with ``DepotWriter`` (a new save of the same id
  each time, ``overwrite=True``) against ``FileSystemWriter`` on a tmpfs
  (``/dev/shm``) and on the disk (fsync of every file, as its default).
  Goal: at most 1.0x the tmpfs writer.
* **D2.** ``dcp.load`` into the state dict's tensors with ``DepotReader``
  (a copy from shared memory into them) against ``FileSystemReader`` of
  the same checkpoints (the disk's page cache warm).  Goal: at most 1.0x
  the tmpfs reader.
* **D3.** ``dcp.load`` with ``ZeroCopyLoadPlanner``: the state dict gets
  the broker's bytes themselves.  Goal: at most 0.1x the tmpfs reader.
* **D4, D5.** The first ``dcp.save`` and the first ``dcp.load`` of a new
  process (cold: its client connects and maps the broker's segments for the
  first time; torch and the state dict are made before the clock starts),
  against ``FileSystemWriter`` and ``FileSystemReader`` on a tmpfs, each in
  a new process too.  The broker is running.  Goal: at most 1.0x.

Every repetition runs each system once, in rotating order; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import run as suite  # the B-suite's helpers: series, check, machine, versions, teardown
import torch
import torch.distributed.checkpoint as dcp
from _harness import BrokerProc
from tensordepot import Client
from tensordepot.checkpoint import DepotReader, DepotWriter, ZeroCopyLoadPlanner

MiB, GiB = 1 << 20, 1 << 30
# DCP says so each time it runs without a process group.
warnings.filterwarnings("ignore", "torch.distributed is disabled")
warnings.filterwarnings("ignore", "Detected an existing checkpoint")  # FileSystemWriter, each rep


@dataclass(frozen=True)
class Config:
    mode: str
    tensors: int
    tensor_bytes: int
    reps: int
    max_memory: str


FULL = Config("full", tensors=64, tensor_bytes=16 * MiB, reps=5, max_memory="6GiB")
QUICK = replace(FULL, mode="quick", tensors=16, tensor_bytes=4 * MiB, reps=2, max_memory="1GiB")


def state(cfg: Config) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n = cfg.tensor_bytes // 4
    return {
        "model": {
            f"layer{i}.weight": torch.randn(n // 1024, 1024, generator=g)
            for i in range(cfg.tensors)
        }
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_all(cfg: Config, c: Client, tmpfs: Path, disk: Path) -> dict[str, list[float]]:
    sd = state(cfg)
    dest = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    saves: dict[str, Callable[[], Any]] = {
        "depot_save": lambda: dcp.save(
            sd, storage_writer=DepotWriter("bench/ckpt", client=c, overwrite=True)
        ),
        "tmpfs_save": lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmpfs))),
        "disk_save": lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(disk))),
    }

    zeros = {k: torch.zeros_like(v) for k, v in sd["model"].items()}
    into: dict[str, Any] = {}

    def zero_copy() -> None:
        dcp.load(
            into, storage_reader=DepotReader("bench/ckpt", client=c), planner=ZeroCopyLoadPlanner()
        )

    loads: dict[str, Callable[[], Any]] = {
        "depot_load": lambda: dcp.load(dest, storage_reader=DepotReader("bench/ckpt", client=c)),
        "zero_copy_load": zero_copy,
        "tmpfs_load": lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(tmpfs))),
        "disk_load": lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(disk))),
    }
    samples: dict[str, list[float]] = {k: [] for k in (*saves, *loads)}
    for rep in range(cfg.reps + 1):  # the first is a warm-up: pools, page cache, files
        for group in (saves, loads):
            names = list(group)
            names = names[rep % len(names) :] + names[: rep % len(names)]  # rotating order
            for name in names:
                into["model"] = dict(zeros)  # (for zero_copy) tensors to replace, made untimed
                took = timed(group[name])
                if name == "zero_copy_load":
                    assert all(t is not zeros[k] for k, t in into["model"].items()), "adopted"
                if rep:
                    samples[name].append(took)
    for k, v in sd["model"].items():
        assert torch.equal(dest["model"][k], v), k
    return samples


COLD = ("cold_depot_save", "cold_tmpfs_save", "cold_depot_load", "cold_tmpfs_load")


def run_cold(cfg: Config, url: str, tmpfs: Path) -> dict[str, list[float]]:
    """D4, D5: each measurement in a process of its own, made for it."""
    samples: dict[str, list[float]] = {k: [] for k in COLD}
    # A new process per sample, each importing torch: a quick run (CI) takes one.
    for rep in range(cfg.reps if cfg.mode == "full" else 1):
        for group in (COLD[:2], COLD[2:]):
            order = list(group)[rep % 2 :] + list(group)[: rep % 2]
            for name in order:
                res = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        name,
                        "--url",
                        url,
                        "--path",
                        str(tmpfs / "cold"),
                        "--tensors",
                        str(cfg.tensors),
                        "--tensor-bytes",
                        str(cfg.tensor_bytes),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
                if res.returncode != 0:
                    raise RuntimeError(f"{name} failed:\n{res.stderr[-3000:]}")
                samples[name].append(float(res.stdout.split()[-1]))
    return samples


def child(name: str, url: str, path: str, tensors: int, tensor_bytes: int) -> float:
    """One cold measurement, in this new process: seconds."""
    n = tensor_bytes // 4
    sd = {
        "model": {
            f"layer{i}.weight": torch.full((n // 1024, 1024), float(i)) for i in range(tensors)
        }
    }
    if name.endswith("_load"):
        sd = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    ops: dict[str, Callable[[], Any]] = {
        "cold_depot_save": lambda: dcp.save(
            sd, storage_writer=DepotWriter("bench/cold", url=url, overwrite=True)
        ),
        "cold_tmpfs_save": lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path)),
        "cold_depot_load": lambda: dcp.load(sd, storage_reader=DepotReader("bench/cold", url=url)),
        "cold_tmpfs_load": lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(path)),
    }
    took = timed(ops[name])
    if name.endswith("_load"):
        assert float(sd["model"]["layer1.weight"][0, 0]) == 1.0, "loaded"
    return took


def markdown(result: dict[str, Any]) -> str:
    """The README's table for this run."""
    return suite.table(result, f"torch {result['versions'].get('torch')}", digits=1)


def checks(cfg: Config, s: dict[str, list[float]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    size = suite.human(cfg.tensors * cfg.tensor_bytes)
    what = f"{cfg.tensors} float32 tensors, {size}"
    labels = {
        "depot_save": f"dcp.save, DepotWriter, {what}",
        "tmpfs_save": "FileSystemWriter on tmpfs",
        "disk_save": "FileSystemWriter on disk, fsync",
        "depot_load": f"dcp.load, DepotReader (copy into the tensors), {what}",
        "zero_copy_load": "dcp.load, DepotReader + ZeroCopyLoadPlanner",
        "tmpfs_load": "FileSystemReader on tmpfs",
        "disk_load": "FileSystemReader on disk, page cache warm",
        "cold_depot_save": f"first dcp.save of a new process, DepotWriter, {what}",
        "cold_tmpfs_save": "first save of a new process, FileSystemWriter on tmpfs",
        "cold_depot_load": f"first dcp.load of a new process, DepotReader, {what}",
        "cold_tmpfs_load": "first load of a new process, FileSystemReader on tmpfs",
    }
    data = {k: suite.series(labels[k], v, "ms", 1e3) for k, v in s.items()}

    def ratio(a: str, b: str) -> float:
        return suite.median(s[a]) / suite.median(s[b])

    rows = [
        suite.check(
            "D1",
            "D1",
            f"DCP save of {size}: DepotWriter / FileSystemWriter on tmpfs",
            data["depot_save"],
            data["tmpfs_save"],
            ratio("depot_save", "tmpfs_save"),
            "<=",
            1.0,
        ),
        suite.check(
            "D1'",
            "D1",
            f"DCP save of {size}: DepotWriter / FileSystemWriter on disk",
            data["depot_save"],
            data["disk_save"],
            ratio("depot_save", "disk_save"),
            "info",
        ),
        suite.check(
            "D2",
            "D2",
            f"DCP load of {size}: DepotReader / FileSystemReader on tmpfs",
            data["depot_load"],
            data["tmpfs_load"],
            ratio("depot_load", "tmpfs_load"),
            "<=",
            1.0,
        ),
        suite.check(
            "D2'",
            "D2",
            f"DCP load of {size}: DepotReader / FileSystemReader on disk",
            data["depot_load"],
            data["disk_load"],
            ratio("depot_load", "disk_load"),
            "info",
        ),
        suite.check(
            "D3",
            "D3",
            f"DCP zero-copy load of {size} / FileSystemReader on tmpfs",
            data["zero_copy_load"],
            data["tmpfs_load"],
            ratio("zero_copy_load", "tmpfs_load"),
            "<=",
            0.1,
        ),
        suite.check(
            "D4",
            "D4",
            f"cold: first DCP save of {size} in a new process: DepotWriter "
            f"/ FileSystemWriter on tmpfs",
            data["cold_depot_save"],
            data["cold_tmpfs_save"],
            ratio("cold_depot_save", "cold_tmpfs_save"),
            "<=",
            1.0,
        ),
        suite.check(
            "D5",
            "D5",
            f"cold: first DCP load of {size} in a new process: DepotReader "
            f"/ FileSystemReader on tmpfs",
            data["cold_depot_load"],
            data["cold_tmpfs_load"],
            ratio("cold_depot_load", "cold_tmpfs_load"),
            "<=",
            1.0,
        ),
    ]
    return data, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB and few repetitions (CI)")
    ap.add_argument("--out", default="bench-results/dcp.json", help="where to write the JSON")
    ap.add_argument("--shm-prefix", help="segment prefix of the broker this run starts")
    ap.add_argument(
        "--disk",
        default=None,
        help="a folder on the disk (default: a temporary one beside this repository)",
    )
    ap.add_argument("--report", metavar="JSON", help="print the README table of an earlier run")
    ap.add_argument("--child", choices=COLD, help=argparse.SUPPRESS)  # one cold measurement
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tensor-bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(child(args.child, args.url, args.path, args.tensors, args.tensor_bytes))
        return 0
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    cfg = QUICK if args.quick else FULL
    prefix = args.shm_prefix or f"tdbench-{secrets.token_hex(4)}-"
    started = time.monotonic()
    result = suite.head("dcp.py", cfg.mode, args.out, cfg)
    tmpfs = Path(tempfile.mkdtemp(prefix="tdbench-dcp-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="tdbench-dcp-", dir=args.disk or HERE.parent.parent))
    broker = BrokerProc(
        "--warm-memory",
        cfg.max_memory,
        "--reap-interval",
        "0.5",
        max_memory=cfg.max_memory,
        prefix=prefix,
    )
    try:
        with broker.client() as c:
            samples = run_all(cfg, c, tmpfs, disk)
            samples.update(run_cold(cfg, broker.url, tmpfs))
            c.delete(prefix="bench/")  # teardown counts what is left
        result["benchmarks"], result["checks"] = checks(cfg, samples)
        result["teardown"] = suite.teardown(broker)
    finally:
        broker.cleanup()
        shutil.rmtree(tmpfs, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    out = suite.written(result, args.out, started, {})
    print(markdown(result))
    print(f"[{time.monotonic() - started:5.1f} s] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
