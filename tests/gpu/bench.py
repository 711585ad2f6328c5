"""GPU benchmarks G1..G4, each against its peer in the same run.

    python tests/gpu/bench.py --out gpu-results/gpu-bench.json

* **G1** open a 1 GiB CUDA tensor in another process: tensordepot ``get`` +
  ``torch.from_dlpack`` + read one element, against a torch.multiprocessing
  Queue carrying the tensor + the same read.  Cold (a fresh consumer
  process, its first open; median over several processes) and warm (the
  same process again).  Goal: ratio <= 1.0, both.
* **G2** ``put`` of a 1 GiB CUDA tensor against a device-to-device copy of
  1 GiB in the same run.  Goal: bandwidth ratio >= 0.8.
* **G3** a 4 KiB CUDA handoff (put, the consumer's long-poll get, read, ack)
  against a torch.multiprocessing Queue of CUDA tensors.  Goal: <= 1.0.
* **G4** a 300-tensor, ~1 GiB CUDA state dict: ``put_many`` + ``get_many``
  (+ ``torch.from_dlpack`` of each) against device copies of the same
  tensors.  Goal: <= 2x, and at most 3 control round trips.

Nothing is asserted; every figure goes to the JSON with its samples, and a
missed goal stays there as a miss.  Needs a CUDA GPU, torch and cupy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _p in (str(HERE), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _gpu_procs
from _harness import BrokerProc

MiB = 1 << 20
GiB = 1 << 30


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def row(
    cid: str,
    what: str,
    ours_s: float | None,
    peer_s: float | None,
    peer: str,
    measured: float | None,
    op: str,
    goal: float,
    unit: str = "x",
    note: str = "",
) -> dict[str, Any]:
    ok = None if measured is None else (measured <= goal if op == "<=" else measured >= goal)
    return {
        "id": cid,
        "what": what,
        "tensordepot_ms": None if ours_s is None else ours_s * 1e3,
        "peer": peer,
        "peer_ms": None if peer_s is None else peer_s * 1e3,
        "measured": measured,
        "unit": unit,
        "goal": f"{op} {goal:g}",
        "pass": ok,
        "note": note,
    }


def timed(fn: Any, reps: int, warmup: int = 2) -> list[float]:
    out = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def g1(
    torch: Any, c: Any, url: str, size: int, procs: int, warm: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    big = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    c.put("g1", big)
    c.put("g1.tiny", torch.ones(1024, device="cuda"))
    depot_cold, depot_warm = [], []
    for _ in range(procs):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_gpu_procs.g1_depot, args=(url, "g1", warm, w))
        p.start()
        w.close()
        samples = r.recv()
        p.join(60)
        depot_cold.append(samples[0])
        depot_warm.extend(samples[1:])
    torch_cold, torch_warm = [], []
    for _ in range(procs):
        q = ctx.Queue()
        go_r, go_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_gpu_procs.g1_torch, args=(q, go_r, out_w, warm))
        p.start()
        out_w.close()
        tiny = torch.ones(1024, device="cuda")  # kept alive while the consumer may read it
        q.put(tiny)
        samples = None
        while samples is None:
            msg = out_r.recv()
            if msg == "ready":
                q.put(big)
                time.sleep(0.05)  # the queue's feeder thread has sent it before the clock starts
                go_w.send("go")
            else:
                samples = msg
        p.join(60)
        torch_cold.append(samples[0])
        torch_warm.extend(samples[1:])
    c.delete("g1")
    c.delete("g1.tiny")
    dc, dw, tc, tw = med(depot_cold), med(depot_warm), med(torch_cold), med(torch_warm)
    rows = [
        row(
            "G1.cold",
            f"open {size // MiB} MiB in a fresh process: get + from_dlpack + read / torch Queue",
            dc,
            tc,
            "torch.multiprocessing Queue, first tensor in the process",
            dc / tc,
            "<=",
            1.0,
        ),
        row(
            "G1.warm",
            f"open {size // MiB} MiB again in the same process / torch Queue",
            dw,
            tw,
            "torch.multiprocessing Queue, later tensors",
            dw / tw,
            "<=",
            1.0,
        ),
    ]
    return rows, {
        "depot_cold": depot_cold,
        "depot_warm": depot_warm,
        "torch_cold": torch_cold,
        "torch_warm": torch_warm,
    }


def g2(torch: Any, c: Any, size: int, reps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def memcpy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    copy = timed(memcpy, reps)
    # each put retires the last: the block is reused warm
    put = timed(lambda: c.put("g2", src), reps)
    c.delete("g2")
    ratio = med(copy) / med(put)
    return [
        row(
            "G2",
            f"put {size // MiB} MiB on the GPU: bandwidth / device-to-device copy",
            med(put),
            med(copy),
            "cudaMemcpy D2D (torch copy_ + synchronize)",
            ratio,
            ">=",
            0.8,
        )
    ], {"put": put, "memcpy": copy}


def g3(
    torch: Any, c: Any, url: str, iters: int, warmup: int, gap: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    total = iters + warmup

    def handoffs(send: Any, ack: Any) -> list[float]:
        out = []
        for i in range(total):
            # 4 KiB, new each time
            x = torch.full((1024,), float(i), dtype=torch.float32, device="cuda")
            torch.cuda.synchronize()
            time.sleep(gap)  # the consumer is back in its receive
            t0 = time.perf_counter()
            send(x)
            got = float(ack.recv_bytes())
            dt = time.perf_counter() - t0
            if got != float(i):
                raise AssertionError(f"handoff {i}: the consumer read {got}")
            if i >= warmup:
                out.append(dt)
            del x
        return out

    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_gpu_procs.g3_depot, args=(url, "g3", total, w))
    p.start()
    w.close()
    r.recv_bytes()
    depot = handoffs(lambda x: c.put("g3", x), r)
    p.join(60)
    c.delete("g3")
    q = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_gpu_procs.g3_torch, args=(q, w))
    p.start()
    w.close()
    r.recv_bytes()
    peer = handoffs(q.put, r)
    q.put(None)
    p.join(60)
    return [
        row(
            "G3",
            "4 KiB CUDA handoff: tensordepot / torch.multiprocessing Queue",
            med(depot),
            med(peer),
            "torch.multiprocessing Queue, a new CUDA tensor per handoff",
            med(depot) / med(peer),
            "<=",
            1.0,
        )
    ], {"depot": depot, "torch": peer}


def g4(
    torch: Any, c: Any, reps: int, big: int, small: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    sd = {f"layer.{i}.weight": torch.randn(big // 4, device="cuda") for i in range(100)}
    sd.update({f"layer.{i}.norm": torch.randn(small // 4, device="cuda") for i in range(200)})
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    dsts = {k: torch.empty_like(v) for k, v in sd.items()}

    def copies() -> None:
        for k, v in sd.items():
            dsts[k].copy_(v)
        torch.cuda.synchronize()

    trips: list[int] = []

    def batch() -> None:
        before = c.round_trips
        c.put_many(sd)
        got = c.get_many(list(sd))
        views = [torch.from_dlpack(t) for t in got.values()]
        views[-1][0].item()
        trips.append(c.round_trips - before)
        del views, got

    copy = timed(copies, reps)
    ours = timed(batch, reps)
    for k in sd:
        c.delete(k)
    ratio = med(ours) / med(copy)
    what = f"state dict of 300 tensors, {nbytes / GiB:.3g} GiB on the GPU: put_many + get_many"
    return [
        row(
            "G4",
            what + " / device copies of the same tensors",
            med(ours),
            med(copy),
            "300 device-to-device copies + synchronize",
            ratio,
            "<=",
            2.0,
        ),
        row(
            "G4.rt",
            "put_many + get_many: control round trips",
            None,
            None,
            "",
            float(max(trips)),
            "<=",
            3.0,
            unit="round trips",
            note="the largest count of any repetition",
        ),
    ], {"batch": ours, "copies": copy, "round_trips": trips, "bytes": nbytes}


def machine(torch: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,uuid",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-results/gpu-bench.json")
    ap.add_argument(
        "--size", type=int, default=GiB, help="bytes of the G1/G2 tensor (default 1 GiB)"
    )
    ap.add_argument("--only", help="comma-separated subset, e.g. G1,G3")
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing  # registers how a Queue carries CUDA tensors

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure", file=sys.stderr)
        return 2
    only = set(args.only.split(",")) if args.only else {"G1", "G2", "G3", "G4"}
    started = time.time()
    result: dict[str, Any] = {
        "schema": 1,
        "date": datetime.date.today().isoformat(),
        "machine": machine(torch),
        "rows": [],
        "samples": {},
        "errors": {},
    }
    broker = BrokerProc(
        "--cuda-memory",
        f"{max(8, 3 * args.size // GiB + 4)}GiB",
        "--cuda-segment-size",
        "256MiB",
        max_memory="1GiB",
    )
    try:
        from tensordepot import Client

        with Client(broker.url) as c:
            steps = {
                "G1": lambda: g1(torch, c, broker.url, args.size, procs=5, warm=20),
                "G2": lambda: g2(torch, c, args.size, reps=10),
                "G3": lambda: g3(torch, c, broker.url, iters=200, warmup=20, gap=0.002),
                "G4": lambda: g4(torch, c, reps=5, big=8 * MiB, small=1280 * 1024),
            }
            for name, step in steps.items():
                if name not in only:
                    continue
                t0 = time.time()
                try:
                    rows, samples = step()
                    result["rows"] += rows
                    result["samples"][name] = samples
                except Exception as exc:  # one failed benchmark must not hide the others
                    result["errors"][name] = f"{type(exc).__name__}: {exc}"
                print(f"{name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            result["broker_stat"] = c.stat().model_dump()
    finally:
        broker.stop()
        broker.cleanup()
    result["seconds"] = round(time.time() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for r in result["rows"]:
        verdict = {True: "pass", False: "MISS", None: "info"}[r["pass"]]
        print(
            f"{r['id']:7} {verdict:4} {r['measured']!s:>24} {r['unit']:12} goal {r['goal']:7} "
            f"{r['what']}"
        )
    for name, err in result["errors"].items():
        print(f"{name} ERROR {err}")
    print(f"wrote {out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
