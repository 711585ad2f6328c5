"""The benchmark suite: B1..B10, each against its peers, in one run.

    python tests/bench/run.py [--quick] [--out bench-results/bench.json]
    python tests/bench/report.py bench-results/bench.json     # README table + docs/bench.png

It starts its own ``tensordepot serve`` (8 GiB limit, pool memory created at
start), runs every benchmark and its peers in this one run, takes several
repetitions, and writes medians, ratios and a pass/miss per goal to JSON.
Goals are ratios against peers measured here, never absolute times: on a
shared 2-core machine absolute numbers drift, ratios much less.  Nothing is
asserted: a missed goal stays in the JSON with a reason (tests/bench/reasons.json
holds the reasons found by profiling, by check id or benchmark; a miss without
one gets a default note).

``--quick`` uses small sizes (8 MiB instead of 1 GiB), fewer repetitions and
concurrency 1 and 2, so CI can run it in well under a minute; its ratios mean
little and only show that the suite works.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import mmap
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _p in (str(HERE), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _procs
import numpy as np
from _harness import BrokerProc, wait_for
from tensordepot import Client, DepotError, Stat

SCHEMA = 1
MiB = 1 << 20
GiB = 1 << 30
REASONS = HERE / "reasons.json"
DEFAULT_REASON = "missed in this run; not profiled yet"
QUICK_REASON = "quick mode: at small sizes fixed costs dominate; judge this goal on a full run"


@dataclass(frozen=True)
class Config:
    mode: str
    big: int  # bytes of the large tensor (B1, B2, B6)
    reps: int  # repetitions of B1 (each peer)
    get_reps: int  # B2 gets per size
    read_reps: int  # B2 full reads, each way
    handoff_iters: int  # B3 timed handoffs per peer
    handoff_warm: int
    handoff_gap: float  # s between handoffs, so the consumer is waiting when the producer sends
    sd_big: tuple[int, ...]  # B4: 100 weights of this shape ...
    sd_small: tuple[int, ...]  # ... and 200 biases/norms of this one (float32)
    sd_reps: int
    concurrency: tuple[int, ...]  # B5 client processes
    ops_seconds: float  # B5 length of one timed run
    ops_reps: int
    mem_reps: int  # B6
    batch_n: int  # B8: tensors in the dict ...
    batch_elems: int  # ... of this many float32 each
    batch_iters: int  # B8 timed handoffs per peer
    batch_warm: int
    cold: int  # B9: bytes of the first put into a fresh broker
    cold_reps: int  # B9: fresh brokers (one cold put each)
    ops_variants: tuple[str, ...] = ("tensordepot_get", "tensordepot_stat", "bare_fastapi")
    max_memory: str = "8GiB"
    warm_memory: str = "6GiB"
    prealloc: str = "1GiB"


FULL = Config(
    "full",
    big=GiB,
    reps=5,
    get_reps=50,
    read_reps=11,
    handoff_iters=200,
    handoff_warm=20,
    handoff_gap=0.005,
    sd_big=(640, 1024),
    sd_small=(7680,),
    sd_reps=15,
    concurrency=(1, 4, 16),
    ops_seconds=1.0,
    ops_reps=3,
    mem_reps=3,
    batch_n=1000,
    batch_elems=256,
    batch_iters=40,
    batch_warm=5,
    cold=GiB,
    cold_reps=3,
)
QUICK = replace(
    FULL,
    mode="quick",
    big=8 * MiB,
    reps=3,
    get_reps=20,
    read_reps=3,
    handoff_iters=30,
    handoff_warm=5,
    handoff_gap=0.003,
    sd_big=(20, 1024),
    sd_small=(240,),
    sd_reps=2,
    concurrency=(1, 2),
    ops_seconds=0.2,
    ops_reps=2,
    mem_reps=1,
    batch_n=200,
    batch_iters=6,
    batch_warm=2,
    cold=16 * MiB,
    cold_reps=2,
    ops_variants=("tensordepot_get", "bare_fastapi"),
    max_memory="1GiB",
    warm_memory="512MiB",
    prealloc="64MiB",
)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def human(nbytes: int) -> str:
    return f"{nbytes / GiB:.3g} GiB" if nbytes >= GiB else f"{nbytes / MiB:.3g} MiB"


def series(label: str, samples: list[float], unit: str, scale: float = 1.0) -> dict[str, Any]:
    """One measured series: its raw samples and median, in ``unit``."""
    vals = [s * scale for s in samples]
    return {"label": label, "unit": unit, "median": median(vals), "samples": vals, "n": len(vals)}


def check(
    cid: str,
    bench: str,
    what: str,
    ours: dict[str, Any] | None,
    peer: dict[str, Any] | None,
    measured: float | None,
    op: str,
    goal: float | None = None,
    unit: str = "x",
    note: str = "",
) -> dict[str, Any]:
    """One row of the result table: a measured value against its goal.
    ``op`` is ">=", "<=" or "<"; "info" rows carry a figure and no goal."""
    ok: bool | None
    if op == "info" or measured is None or goal is None:
        ok = None
    elif op == ">=":
        ok = measured >= goal
    elif op == "<=":
        ok = measured <= goal
    elif op == "<":
        ok = measured < goal
    else:
        raise ValueError(op)
    return {
        "id": cid,
        "bench": bench,
        "what": what,
        "ours": ours,
        "peer": peer,
        "measured": measured,
        "unit": unit,
        "goal": "" if goal is None else f"{op} {goal:g}",
        "goal_op": op,
        "goal_value": goal,
        "pass": ok,
        "note": note,
        "reason": "",
    }


# -- B1 --------------------------------------------------------------------------


def two_thread_copy(dst: np.ndarray, src: np.ndarray, ex: ThreadPoolExecutor) -> None:
    half = src.size // 2
    futs = [
        ex.submit(np.copyto, dst[:half], src[:half]),
        ex.submit(np.copyto, dst[half:], src[half:]),
    ]
    for f in futs:
        f.result()


class TorchPeer:
    """One consumer process for every torch.multiprocessing peer (B1 and B3).

    Importing torch takes seconds, so the consumer is started once, first,
    and imports torch while the broker starts; this process imports
    ``torch.multiprocessing`` on a thread meanwhile (that import registers the
    reductions that move a queued tensor into shared memory and send its fd)."""

    def __init__(self) -> None:
        self.available = importlib.util.find_spec("torch") is not None
        self._ready = False
        if not self.available:
            return
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.ack, w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_procs.handoff_torch, args=(self.q, w), daemon=True)
        self.proc.start()
        w.close()  # the child holds the write end: its death reads as EOF here
        self._import = threading.Thread(
            target=importlib.import_module, args=("torch.multiprocessing",), daemon=True
        )
        self._import.start()

    def wait_ready(self) -> Any:
        """The torch module, once the consumer is ready."""
        if not self._ready:
            self._import.join()
            self.ack.recv_bytes()
            self._ready = True
        import torch

        return torch

    def close(self) -> None:
        if self.available:
            self.q.put(None)
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def torch_fresh_share(peer: TorchPeer, src: np.ndarray, reps: int) -> list[float] | None:
    """Share a fresh tensor through a torch.multiprocessing Queue, until the consumer has it."""
    if not peer.available:
        return None
    torch = peer.wait_ready()
    base = torch.from_numpy(src)
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        t = base.clone()  # a fresh tensor in the producer's private memory, untimed
        t[0] = float(i)
        t0 = time.perf_counter()
        peer.q.put(t)  # moves the storage into new shared memory, then sends its fd
        got = float(peer.ack.recv_bytes())
        times.append(time.perf_counter() - t0)
        assert got == float(i), (got, i)
        del t
    return times[1:]


def ray_put(src: np.ndarray, reps: int) -> dict[str, Any]:
    """``ray.put`` of the same array, when Ray is importable (never required)."""
    try:
        import ray
    except ImportError:
        return {"skipped": "ray is not installed"}
    try:
        ray.init(
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=3 * src.nbytes + 256 * MiB,
            logging_level="ERROR",
        )
        try:
            ref = ray.put(src)  # warm the store
            del ref
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                ref = ray.put(src)
                times.append(time.perf_counter() - t0)
                del ref
            return {"samples": times, "version": ray.__version__}
        finally:
            ray.shutdown()
    except Exception as exc:  # an optional peer must not sink the run
        return {"skipped": f"ray failed: {exc.__class__.__name__}: {exc}"}


def bench_b1(
    c: Client, cfg: Config, peer: TorchPeer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n = cfg.big
    src = np.full(n // 4, 1.5, dtype=np.float32)
    dst = np.zeros_like(src)  # touched: a warm private buffer
    for _ in range(2):  # warm: the two segments that consecutive versions alternate between
        c.put("b1", src)
    put, copy = [], []
    with ThreadPoolExecutor(2) as ex:
        two_thread_copy(dst, src, ex)
        for _ in range(cfg.reps):  # interleaved, so drift on a shared machine hits both
            t0 = time.perf_counter()
            c.put("b1", src)
            put.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            two_thread_copy(dst, src, ex)
            copy.append(time.perf_counter() - t0)
    c.delete("b1")
    dst = np.empty(0, np.float32)  # give the buffer back before the torch peer clones the source
    gc.collect()
    torch_t = torch_fresh_share(peer, src, cfg.reps)
    ray = ray_put(src, cfg.reps)
    gb = n / 1e9
    s_put = series(f"put {human(n)}", put, "ms", 1e3)
    s_copy = series(f"2-thread numpy copy {human(n)}", copy, "ms", 1e3)
    data: dict[str, Any] = {
        "nbytes": n,
        "put": s_put,
        "copy_2_threads": s_copy,
        "put_gbps": gb / median(put),
        "copy_gbps": gb / median(copy),
    }
    checks = [
        check(
            "B1.copy",
            "B1",
            f"put {human(n)} (warm pool): bandwidth / 2-thread numpy copy",
            s_put,
            s_copy,
            median(copy) / median(put),
            ">=",
            0.8,
        )
    ]
    if torch_t is not None:
        s_torch = series(f"torch.multiprocessing fresh share {human(n)}", torch_t, "ms", 1e3)
        data["torch_fresh_share"] = s_torch
        checks.append(
            check(
                "B1.torch",
                "B1",
                f"put {human(n)}: speed-up over torch.multiprocessing sharing a fresh tensor",
                s_put,
                s_torch,
                median(torch_t) / median(put),
                ">=",
                5,
            )
        )
    else:
        data["torch_fresh_share"] = {"skipped": "torch is not installed"}
    if "samples" in ray:
        s_ray = series(f"ray.put {human(n)}", ray["samples"], "ms", 1e3)
        data["ray_put"] = {**s_ray, "version": ray["version"]}
        checks.append(
            check(
                "B1.ray",
                "B1",
                f"put {human(n)}: speed-up over ray.put (information)",
                s_put,
                s_ray,
                median(ray["samples"]) / median(put),
                "info",
            )
        )
    else:
        data["ray_put"] = ray
    return data, checks


# -- B2 --------------------------------------------------------------------------


def bench_b2(c: Client, cfg: Config) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    c.put("b2.big", np.full(cfg.big // 4, 2.0, dtype=np.float32))
    c.put("b2.small", np.full(256, 2.0, dtype=np.float32))  # 1 KiB

    def get_read(name: str) -> float:
        t0 = time.perf_counter()
        t = c.get(name)
        a = np.from_dlpack(t)
        value = a[-1].item()
        dt = time.perf_counter() - t0
        assert value == 2.0
        del a, t
        return dt

    def get_read_all() -> float:
        t0 = time.perf_counter()
        t = c.get("b2.big")
        total = int(np.from_dlpack(t).view(np.uint64).sum(dtype=np.uint64))
        dt = time.perf_counter() - t0
        assert total == want
        del t
        return dt

    for _ in range(5):  # warm: each segment mapped once
        get_read("b2.big")
        get_read("b2.small")
    big, small = [], []
    for _ in range(cfg.get_reps):
        big.append(get_read("b2.big"))
        small.append(get_read("b2.small"))
    # Full reads: a get each time, against the same bytes read through one
    # mapping of the segment made before (what torch.mp or Ray readers keep).
    t = c.get("b2.big")
    w = t._window  # a range of a kept mapping (offset), or a window of its own
    segment = w.name
    offset = w.offset if hasattr(w, "offset") else w._start + (w.address - w._base)
    del w
    want = int(np.from_dlpack(t).view(np.uint64).sum(dtype=np.uint64))
    del t
    fd = os.open(f"/dev/shm/{segment}", os.O_RDONLY)
    kept = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    os.close(fd)
    view = np.frombuffer(kept, np.uint64, cfg.big // 8, offset)
    full, through = [], []
    for i in range(2 + cfg.read_reps):
        d_get = get_read_all()
        t0 = time.perf_counter()
        assert int(view.sum(dtype=np.uint64)) == want
        d_kept = time.perf_counter() - t0
        if i >= 2:
            full.append(d_get)
            through.append(d_kept)
    del view
    kept.close()
    c.delete("b2.big")
    c.delete("b2.small")
    s_big = series(f"get + read 1 element, {human(cfg.big)}", big, "ms", 1e3)
    s_small = series("get + read 1 element, 1 KiB", small, "ms", 1e3)
    s_full = series(f"get + read every byte, {human(cfg.big)}", full, "ms", 1e3)
    s_kept = series(
        f"the same bytes read through a mapping made once, {human(cfg.big)}", through, "ms", 1e3
    )
    data = {
        "big_nbytes": cfg.big,
        "small_nbytes": 1024,
        "get_big": s_big,
        "get_small": s_small,
        "get_read_all": s_full,
        "kept_read_all": s_kept,
    }
    return data, [
        check(
            "B2.read",
            "B2",
            f"get + read every byte of {human(cfg.big)} / the same read through a kept mapping",
            s_full,
            s_kept,
            median(full) / median(through),
            "<=",
            1.2,
        ),
        check(
            "B2",
            "B2",
            f"get + read one element: {human(cfg.big)} / 1 KiB",
            s_big,
            s_small,
            median(big) / median(small),
            "<=",
            1.5,
        ),
    ]


# -- B3 --------------------------------------------------------------------------


def _handoffs(
    prepare: Callable[[int], Any],
    send: Callable[[Any], Any],
    ack: Any,
    cfg: Config,
    scale: int = 1,
) -> list[float]:
    """Time ``send(prepare(i))`` until the consumer acknowledges value ``i``
    (times ``scale``: what a consumer that adds up many reads sends back).
    ``prepare`` (untimed) makes the value the producer hands over."""
    return _interleaved(prepare, {"one": (send, ack)}, cfg, scale)["one"]


def _interleaved(
    prepare: Callable[[int], Any],
    sides: dict[str, tuple[Callable[[Any], Any], Any]],
    cfg: Config,
    scale: int = 1,
    block: int = 10,
) -> dict[str, list[float]]:
    """``_handoffs`` of each side (its ``send`` and its consumer's ``ack``),
    ``block`` handoffs of one side, then of the next, the order reversed
    each round, so that drift on a shared machine (a benchmark before this
    one still giving memory back) reaches every side alike."""
    total = cfg.handoff_warm + cfg.handoff_iters
    times: dict[str, list[float]] = {k: [] for k in sides}
    done = dict.fromkeys(sides, 0)
    order = list(sides)
    while any(n < total for n in done.values()):
        for k in order:
            send, ack = sides[k]
            for i in range(done[k], min(done[k] + block, total)):
                payload = prepare(i)
                time.sleep(cfg.handoff_gap)  # the consumer is back in its receive (or long poll)
                t0 = time.perf_counter()
                send(payload)
                got = float(ack.recv_bytes())
                dt = time.perf_counter() - t0
                if got != float(i * scale):
                    raise AssertionError(
                        f"{k}, handoff {i}: the consumer read {got}, not {i * scale}"
                    )
                if i >= cfg.handoff_warm:
                    times[k].append(dt)
                del payload
            done[k] = min(done[k] + block, total)
        order.reverse()
    return times


def bench_b3(
    c: Client, cfg: Config, url: str, peer: TorchPeer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    x = np.arange(1024, dtype=np.float32)  # 4 KiB
    results: dict[str, list[float]] = {}

    def set_first(i: int) -> np.ndarray:
        x[0] = i
        return x

    # tensordepot: the consumer waits in get(newer_than=last) before each put.
    r, w = ctx.Pipe(duplex=False)
    total = cfg.handoff_warm + cfg.handoff_iters
    p = ctx.Process(target=_procs.handoff_depot, args=(url, "b3", total, w), daemon=True)
    p.start()
    w.close()  # the child holds the write end: its death reads as EOF here
    r.recv_bytes()
    results["tensordepot"] = _handoffs(set_first, lambda a: c.put("b3", a), r, cfg)
    p.join(30)
    c.delete("b3")

    # multiprocessing Pipe of the pickled array.
    r, w = ctx.Pipe(duplex=False)
    a_end, b_end = ctx.Pipe()
    p = ctx.Process(target=_procs.handoff_pipe, args=(b_end, w), daemon=True)
    p.start()
    w.close()  # the child holds the write end: its death reads as EOF here
    b_end.close()
    r.recv_bytes()
    results["pipe"] = _handoffs(set_first, a_end.send, r, cfg)
    a_end.send(None)
    p.join(30)

    if peer.available:
        torch = peer.wait_ready()
        base = torch.from_numpy(x.copy())

        def fresh(i: int) -> Any:
            # A new tensor per handoff, as a producer that computes a new value
            # has; q.put moves it into new shared memory and sends its fd.
            t = base.clone()
            t[0] = i
            return t

        results["torch_fresh"] = _handoffs(fresh, peer.q.put, peer.ack, cfg)
        # One buffer, moved to shared memory once and sent again and again;
        # the producer overwrites it while a consumer may still read it.
        shared = base.clone().share_memory_()

        def same(i: int) -> Any:
            shared[0] = i
            return shared

        results["torch_same_buffer"] = _handoffs(same, peer.q.put, peer.ack, cfg)

    labels = {
        "tensordepot": "tensordepot put -> get (long poll) -> ack",
        "pipe": "multiprocessing Pipe, pickled array",
        "torch_fresh": "torch.multiprocessing Queue, new tensor per handoff",
        "torch_same_buffer": "torch.multiprocessing Queue, one shared buffer re-sent",
    }
    data: dict[str, Any] = {
        "nbytes": x.nbytes,
        "gap_s": cfg.handoff_gap,
        "ack": "raw multiprocessing Pipe, the same for every peer",
    }
    for k, v in results.items():
        data[k] = series(labels[k], v, "ms", 1e3)
    ours = data["tensordepot"]
    td = median(results["tensordepot"])
    checks = []
    if "torch_fresh" in results:
        checks.append(
            check(
                "B3",
                "B3",
                "4 KiB handoff: tensordepot / torch.multiprocessing Queue",
                ours,
                data["torch_fresh"],
                td / median(results["torch_fresh"]),
                "<=",
                2.5,
                note="torch sends a new tensor per handoff, as tensordepot publishes a new version",
            )
        )
        checks.append(
            check(
                "B3.same",
                "B3",
                "4 KiB handoff: tensordepot / torch Queue re-sending one shared buffer "
                "(information)",
                ours,
                data["torch_same_buffer"],
                td / median(results["torch_same_buffer"]),
                "info",
                note="racy: the producer overwrites a buffer the consumer may still read",
            )
        )
    checks.append(
        check(
            "B3'.pipe",
            "B3",
            "4 KiB handoff: tensordepot / multiprocessing Pipe of the pickled array",
            ours,
            data["pipe"],
            td / median(results["pipe"]),
            "<=",
            2,
        )
    )
    if "torch_fresh" in results:
        checks.append(
            check(
                "B3'.torch",
                "B3",
                "4 KiB handoff: tensordepot / torch.multiprocessing Queue (the new goal)",
                ours,
                data["torch_fresh"],
                td / median(results["torch_fresh"]),
                "<=",
                0.8,
            )
        )
    return data, checks


# -- B4 --------------------------------------------------------------------------


def state_dict(cfg: Config, prefix: str) -> dict[str, np.ndarray]:
    sd = {}
    for i in range(100):
        sd[f"{prefix}.layers.{i}.weight"] = np.full(cfg.sd_big, i, dtype=np.float32)
        sd[f"{prefix}.layers.{i}.bias"] = np.full(cfg.sd_small, i, dtype=np.float32)
        sd[f"{prefix}.layers.{i}.norm"] = np.full(cfg.sd_small, -i, dtype=np.float32)
    return sd


def _drain(c: Client) -> None:
    """Wait until every lease this run took is released (releases are sent in the background)."""
    gc.collect()
    wait_for(lambda: c.stat().leases == 0, 30, what="leases to be released")


def _timed(c: Client, fn: Callable[[], Any], expect: int) -> tuple[float, int]:
    """(seconds, control round trips) of ``fn()``, which returns ``expect``
    tensors; every earlier lease is released first, and these after."""
    _drain(c)
    rt0 = c.round_trips
    t0 = time.perf_counter()
    got = fn()
    dt = time.perf_counter() - t0
    rts = c.round_trips - rt0
    assert len(got) == expect
    del got
    return dt, rts


def bench_b4(c: Client, cfg: Config) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    batch_sd, single_sd = state_dict(cfg, "b4.batch"), state_dict(cfg, "b4.single")
    batch_names, single_names = list(batch_sd), list(single_sd)
    total = sum(a.nbytes for a in batch_sd.values())

    def batch() -> Any:
        c.put_many(batch_sd)
        return dict(c.get_many(batch_names))  # every SharedTensor made, as the singles' are

    def singles() -> Any:
        for name, a in single_sd.items():
            c.put(name, a)
        return {name: c.get(name) for name in single_names}

    def run(fn: Callable[[], Any]) -> tuple[float, int]:
        return _timed(c, fn, len(batch_names))

    for _ in range(2):  # warm: a new version is allocated while the old one lives, so the
        run(batch)  # ranges of two versions of each state dict get faulted in and mapped
        run(singles)
    b_t, s_t, b_rt, s_rt = [], [], [], []
    for _ in range(cfg.sd_reps):
        dt, rts = run(batch)
        b_t.append(dt)
        b_rt.append(rts)
        dt, rts = run(singles)
        s_t.append(dt)
        s_rt.append(rts)
    _drain(c)
    for name in batch_names + single_names:
        c.delete(name)
    n = len(batch_names)
    s_b = series(f"put_many + get_many, {n} tensors, {human(total)}", b_t, "ms", 1e3)
    s_s = series(f"{n} single put + {n} single get", s_t, "ms", 1e3)
    s_brt = series(
        "put_many + get_many control round trips", [float(x) for x in b_rt], "round trips"
    )
    s_srt = series(
        "single puts + gets control round trips", [float(x) for x in s_rt], "round trips"
    )
    data = {
        "tensors": n,
        "nbytes": total,
        "batch": s_b,
        "singles": s_s,
        "batch_round_trips": s_brt,
        "single_round_trips": s_srt,
    }
    return data, [
        check(
            "B4.rt",
            "B4",
            "put_many + get_many: control round trips",
            s_brt,
            None,
            max(b_rt),
            "<=",
            3,
            unit="round trips",
            note="the largest count of any repetition",
        ),
        check(
            "B4",
            "B4",
            f"state dict of {n} tensors: 300 singles / put_many + get_many",
            s_b,
            s_s,
            median(s_t) / median(b_t),
            ">=",
            5,
        ),
    ]


# -- B7 --------------------------------------------------------------------------


def _balanced_halves(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[list[tuple[Any, Any]]]:
    """Deal (dst, src) copies to two threads, largest first, to the lighter one."""
    halves: list[list[tuple[Any, Any]]] = [[], []]
    load = [0, 0]
    for d, src in sorted(pairs, key=lambda p: -p[1].nbytes):
        i = 0 if load[0] <= load[1] else 1
        halves[i].append((d, src))
        load[i] += src.nbytes
    return halves


def _copy_all(pairs: list[tuple[Any, Any]]) -> None:
    for d, src in pairs:
        np.copyto(d, src)


def bench_b7(c: Client, cfg: Config) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """put_many + get_many of the B4 state dict against a 2-thread copy of its bytes
    into warm memory: the same sources, one destination, split across two threads."""
    sd = state_dict(cfg, "b7")
    names = list(sd)
    total = sum(a.nbytes for a in sd.values())
    dst = np.ones(total, dtype=np.uint8)  # touched: warm, as the broker's pool is
    pairs, off = [], 0
    for a in sd.values():
        pairs.append((dst[off : off + a.nbytes].view(a.dtype).reshape(a.shape), a))
        off += a.nbytes
    halves = _balanced_halves(pairs)

    def batch() -> Any:
        c.put_many(sd)
        return dict(c.get_many(names))  # every SharedTensor made (get_many makes them lazily)

    ex_t, cp_t, rts = [], [], []
    with ThreadPoolExecutor(2) as ex:

        def copy() -> float:
            t0 = time.perf_counter()
            for f in [ex.submit(_copy_all, h) for h in halves]:
                f.result()
            return time.perf_counter() - t0

        for _ in range(2):  # warm: two versions' ranges faulted in and mapped; threads started
            _timed(c, batch, len(names))
            copy()
        for _ in range(cfg.sd_reps):  # interleaved, so drift on a shared machine hits both
            dt, rt = _timed(c, batch, len(names))
            ex_t.append(dt)
            rts.append(rt)
            cp_t.append(copy())
    _drain(c)
    for name in names:
        c.delete(name)
    s_ex = series(f"put_many + get_many, {len(names)} tensors, {human(total)}", ex_t, "ms", 1e3)
    s_cp = series(f"2-thread copy of the same {human(total)} into warm memory", cp_t, "ms", 1e3)
    s_rt = series("put_many + get_many control round trips", [float(x) for x in rts], "round trips")
    data = {
        "tensors": len(names),
        "nbytes": total,
        "exchange": s_ex,
        "copy_2_threads": s_cp,
        "round_trips": s_rt,
    }
    return data, [
        check(
            "B7",
            "B7",
            f"state dict ({len(names)} tensors, {human(total)}): put_many + get_many / "
            f"2-thread copy of its bytes",
            s_ex,
            s_cp,
            median(ex_t) / median(cp_t),
            "<=",
            1.3,
        ),
        check(
            "B7.rt",
            "B7",
            "put_many + get_many: control round trips",
            s_rt,
            None,
            max(rts),
            "<=",
            3,
            unit="round trips",
            note="the largest count of any repetition",
        ),
    ]


# -- B8 --------------------------------------------------------------------------


def bench_b8(c: Client, cfg: Config, url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A dict of small tensors from this process to a consumer process, which
    reads every tensor and acknowledges: put_many -> get_many (waiting for the
    next versions) against a multiprocessing Pipe sending the pickled dict."""
    ctx = mp.get_context("spawn")
    sd = {f"b8.layers.{i}.w": np.zeros(cfg.batch_elems, np.float32) for i in range(cfg.batch_n)}
    names = list(sd)
    total = sum(a.nbytes for a in sd.values())
    loop = replace(cfg, handoff_iters=cfg.batch_iters, handoff_warm=cfg.batch_warm)

    def mark(i: int) -> dict[str, np.ndarray]:
        for a in sd.values():  # untimed: every tensor carries this handoff's number
            a[0] = a[-1] = i
        return sd

    n = len(names)
    # Both consumers wait at once; the handoffs alternate between them in blocks.
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(
        target=_procs.batch_depot,
        daemon=True,
        args=(url, names, loop.handoff_warm + loop.handoff_iters, w),
    )
    p.start()
    w.close()
    r.recv_bytes()
    pr, pw = ctx.Pipe(duplex=False)
    a_end, b_end = ctx.Pipe()
    q = ctx.Process(target=_procs.batch_pipe, args=(b_end, pw), daemon=True)
    q.start()
    pw.close()
    b_end.close()
    pr.recv_bytes()
    sides = {"tensordepot": (c.put_many, r), "pipe": (a_end.send, pr)}
    results = _interleaved(mark, sides, loop, scale=2 * n)
    p.join(30)
    a_end.send(None)
    q.join(30)
    for name in names:
        c.delete(name)

    what = f"{n} float32 tensors of {human(cfg.batch_elems * 4)}"
    labels = {
        "tensordepot": f"tensordepot put_many -> get_many (waiting) -> read all, {what}",
        "pipe": f"multiprocessing Pipe of the pickled dict, {what}",
    }
    data: dict[str, Any] = {"tensors": n, "nbytes": total, "gap_s": loop.handoff_gap}
    for k, v in results.items():
        data[k] = series(labels[k], v, "ms", 1e3)
    return data, [
        check(
            "B8",
            "B8",
            f"{what}, process to process, every tensor read: tensordepot / Pipe of the pickle",
            data["tensordepot"],
            data["pipe"],
            median(results["tensordepot"]) / median(results["pipe"]),
            "<=",
            1.0,
        )
    ]


# -- B9 --------------------------------------------------------------------------


def fresh_copy(src: np.ndarray, prefix: str) -> float:
    """Seconds of one numpy copy of ``src`` into shared memory mapped just
    now and never touched: each page is allocated as the copy first writes it."""
    import mmap

    path = os.path.join("/dev/shm", f"{prefix}peer-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, src.nbytes)
        m = mmap.mmap(fd, src.nbytes)  # MAP_SHARED, no page allocated yet
        dst = np.frombuffer(m, dtype=src.dtype)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        del dst
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return dt


def bench_b9(cfg: Config, prefix: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The first put into a broker started with --prealloc 0 (a new broker each
    repetition), against a numpy copy into never-touched shared memory."""
    n = cfg.cold
    src = np.full(n // 4, 2.5, dtype=np.float32)
    cold, warm, peer = [], [], []
    for rep in range(cfg.cold_reps):
        if rep % 2:  # alternate which goes first, so drift hits both
            peer.append(fresh_copy(src, prefix))
        # Small pool segments: the put gets a segment of its own size, in quick mode too.
        broker = BrokerProc(
            "--prealloc",
            "0",
            "--segment-size",
            "16MiB",
            "--warm-memory",
            str(2 * n),
            max_memory=str(3 * n),
            prefix=f"{prefix}b9-{rep}-",
        )
        try:
            with broker.client() as c:
                c.stat()  # the session and connection exist: only the put is timed
                t0 = time.perf_counter()
                c.put("b9", src)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.put("b9", src)  # a new version while the first lives: a second segment
                c.put("b9", src)  # now into the first version's memory, freed and warm
                warm.append(time.perf_counter() - t0)
                c.delete("b9")
            broker.stop()
        finally:
            broker.cleanup()
        if not rep % 2:
            peer.append(fresh_copy(src, prefix))
    s_cold = series(f"first put of {human(n)} into a broker with --prealloc 0", cold, "ms", 1e3)
    s_peer = series(f"numpy copy of {human(n)} into never-touched shared memory", peer, "ms", 1e3)
    s_warm = series(f"two more puts of {human(n)} (a second segment, then warm)", warm, "ms", 1e3)
    data = {
        "nbytes": n,
        "cold_put": s_cold,
        "fresh_copy": s_peer,
        "next_two_puts": s_warm,
        "shmem_hugepages": _shmem_hugepages(),
    }
    return data, [
        check(
            "B9",
            "B9",
            f"first put of {human(n)} (--prealloc 0) / numpy copy into fresh shared memory",
            s_cold,
            s_peer,
            median(cold) / median(peer),
            "<=",
            1.3,
        )
    ]


def _shmem_hugepages() -> str:
    """What this kernel does for huge pages in shared memory (the bracketed setting)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read().strip()
    except OSError:
        return "unknown"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text


# -- B5 --------------------------------------------------------------------------


class BarePeer:
    """The bare FastAPI endpoint (tests/bench/_bare.py) in a process of its own."""

    def __init__(self, sock_dir: str) -> None:
        self.path = os.path.join(sock_dir, "bare.sock")
        self.url = "unix://" + self.path
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_bare.py"), self.path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def wait_ready(self) -> None:
        from tensordepot.client._transport import Transport

        def up() -> bool:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"the bare endpoint exited with {self.proc.returncode}: {err}")
            if not os.path.exists(self.path):
                return False
            tr = Transport(self.url, timeout=2)
            try:
                return bool(tr.request("GET", "/healthz")["status"] == "ok")
            except DepotError:  # not accepting connections yet
                return False
            finally:
                tr.close()

        wait_for(up, 60, what="the bare FastAPI endpoint")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def procs_text(n: int) -> str:
    return f"{n} client process" + ("es" if n != 1 else "")


def bench_b5(
    c: Client, cfg: Config, url: str, bare_url: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    c.put("b5.small", np.full(256, 3.0, dtype=np.float32))  # 1 KiB
    variants = list(cfg.ops_variants)
    per: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    for n in cfg.concurrency:
        barrier = ctx.Barrier(n + 1)
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_procs.ops_client,
                daemon=True,
                args=(
                    url,
                    bare_url,
                    "b5.small",
                    variants,
                    cfg.ops_reps,
                    cfg.ops_seconds,
                    barrier,
                    out,
                ),
            )
            for _ in range(n)
        ]
        for p in procs:
            p.start()
        for v in variants:
            per[v][n] = []
        for _ in range(cfg.ops_reps):
            for v in variants:
                try:
                    barrier.wait(timeout=300)  # the first wait covers the clients' start
                except threading.BrokenBarrierError:
                    codes = [p.exitcode for p in procs]
                    raise AssertionError(
                        f"B5 clients did not all arrive (exit codes {codes})"
                    ) from None
                rates = 0.0
                for _ in range(n):
                    var, _rep, ops, elapsed = out.get(timeout=120)
                    assert var == v, (var, v)
                    rates += ops / elapsed
                per[v][n].append(rates)
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise AssertionError(f"a B5 client exited with {p.exitcode}")
    c.delete("b5.small")
    labels = {
        "tensordepot_get": "tensordepot get 1 KiB + release",
        "tensordepot_stat": "tensordepot stat",
        "bare_fastapi": "bare FastAPI endpoint, same uvicorn settings",
    }
    data: dict[str, Any] = {
        "concurrency": list(cfg.concurrency),
        "seconds_per_run": cfg.ops_seconds,
        "transport": "tensordepot's http.client transport, one connection per process "
        "(Client(lane=False): no shared-memory lane, no board)",
    }
    for v in variants:
        data[v] = {
            str(n): series(f"{labels[v]}, {procs_text(n)}", xs, "ops/s") for n, xs in per[v].items()
        }
    checks = []
    for n in cfg.concurrency:
        ours, bare = data["tensordepot_get"][str(n)], data["bare_fastapi"][str(n)]
        checks.append(
            check(
                f"B5.{n}",
                "B5",
                f"control-plane ops/s, {procs_text(n)}: get / bare endpoint",
                ours,
                bare,
                ours["median"] / bare["median"],
                ">=",
                1.0 if n >= 16 else 0.7,  # the busiest case has the stricter goal
                note="get of a 1 KiB tensor, then release",
            )
        )
    if "tensordepot_stat" in data:
        for n in cfg.concurrency:
            st, bare = data["tensordepot_stat"][str(n)], data["bare_fastapi"][str(n)]
            checks.append(
                check(
                    f"B5.stat.{n}",
                    "B5",
                    f"control-plane ops/s, {procs_text(n)}: stat / bare endpoint (information)",
                    st,
                    bare,
                    st["median"] / bare["median"],
                    "info",
                )
            )
    return data, checks


# -- B6 --------------------------------------------------------------------------


def bench_b6(cfg: Config, url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    prod, cons = [], []
    for _ in range(cfg.mem_reps):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_procs.memory_producer, args=(url, "b6", cfg.big, w), daemon=True)
        p.start()
        w.close()
        prod.append(r.recv())
        p.join(60)
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_procs.memory_consumer, args=(url, "b6", w), daemon=True)
        p.start()
        w.close()
        cons.append(r.recv())
        p.join(60)
        if not cons[-1]["sum_ok"]:
            raise AssertionError("B6: the consumer read wrong data")
    with Client(url) as c:
        c.delete("b6")
    # The worse of a first put (maps the segment) and a second (reuses it), per repetition.
    growth = [max(x["first"]["peak_growth"], x["second"]["peak_growth"]) for x in prod]
    s_prod = series(
        f"producer RssAnon peak growth during a {human(cfg.big)} put", growth, "MiB", 1 / MiB
    )
    s_cons = series(
        f"consumer Anonymous growth after a {human(cfg.big)} get + full read",
        [x["growth"] for x in cons],
        "MiB",
        1 / MiB,
    )
    data = {
        "nbytes": cfg.big,
        "producer": s_prod,
        "consumer": s_cons,
        "producer_raw": prod,
        "consumer_raw": cons,
    }
    return data, [
        check(
            "B6.producer",
            "B6",
            f"producer RssAnon growth during a {human(cfg.big)} put (MiB)",
            s_prod,
            None,
            s_prod["median"],
            "<",
            64,
            unit="MiB",
            note="peak sampled every 0.5 ms, beyond the source array",
        ),
        check(
            "B6.consumer",
            "B6",
            f"consumer Anonymous growth, {human(cfg.big)} get + full read (MiB)",
            s_cons,
            None,
            s_cons["median"],
            "<",
            16,
            unit="MiB",
        ),
    ]


# -- B10 -------------------------------------------------------------------------

# Handoffs this small, and the rates of small gets, are mostly fixed costs
# (processes woken, a request each way), where a Pipe has the least to do.
_SMALL_HANDOFFS = ("4KiB", "1MiB")


def bench_b10(cfg: Config, url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """tensordepot against Ray, shared_memory + Pipe, torch.multiprocessing
    and the Pipe of the pickle, interleaved (tests/bench/peers.py)."""
    import peers

    data = peers.run(url, cfg.mode == "quick", log=lambda line: print(f"\n{line}", end=""))
    print()
    rows = []
    for cid, case in data["cases"].items():
        ours = case["systems"]["tensordepot"]
        r = peers.ratios(case)
        what = f"{case['what']}: {'time per get, ' * bool(case.get('rate'))}tensordepot"
        if r["vs_ray"] is not None:
            rows.append(
                check(
                    f"B10.{cid}.ray",
                    "B10",
                    f"{what} / Ray",
                    ours,
                    case["systems"]["ray"],
                    r["vs_ray"],
                    "<=",
                    1.0,
                )
            )
        own = peers.best_own(case)
        if own is not None:
            small = cid in _SMALL_HANDOFFS or case.get("rate")
            rows.append(
                check(
                    f"B10.{cid}.own",
                    "B10",
                    f"{what} / best peer with memory of its own",
                    ours,
                    case["systems"][own],
                    r["vs_best_own"],
                    "<=",
                    1.5 if small else 1.0,
                )
            )
    return data, rows


# -- the run -----------------------------------------------------------------------


def _first(path: str, key: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "?"))


def machine() -> dict[str, Any]:
    shm = os.statvfs("/dev/shm")
    mem_kib = _first("/proc/meminfo", "MemTotal").split()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _first("/proc/cpuinfo", "model name") or platform.processor(),
        "memory_bytes": int(mem_kib[0]) * 1024 if mem_kib else None,
        "dev_shm_bytes": shm.f_frsize * shm.f_blocks,
        "kernel": platform.release(),
        "loadavg_start": list(os.getloadavg()),
    }


def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "tensordepot": _version("tensordepot"),
        "fastapi": _version("fastapi"),
        "uvicorn": _version("uvicorn"),
        "ray": _version("ray"),
    }


def reason_for(row: dict[str, Any], mode: str, reasons: dict[str, str]) -> str:
    """Why a goal was missed: quick mode says so; else the reason found by
    profiling (tests/bench/reasons.json, by check id or by benchmark), else a default."""
    if mode == "quick":
        return QUICK_REASON
    return reasons.get(row["id"]) or reasons.get(row["bench"]) or DEFAULT_REASON


def load_reasons() -> dict[str, str]:
    if not REASONS.exists():
        return {}
    return {k: v for k, v in json.loads(REASONS.read_text()).items() if not k.startswith("_")}


def head(script: str, mode: str, out: str, config: Any, **more: str | None) -> dict[str, Any]:
    """The opening of a side suite's result (``flight.py``, ``dcp.py``): what
    ran, when, where, with which versions (``more``: besides ``versions()``)."""
    return {
        "schema": SCHEMA,
        "mode": mode,
        "command": f"python tests/bench/{script}"
        + (" --quick" if mode == "quick" else "")
        + f" --out {out}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": {**versions(), **more},
        "config": asdict(config),
    }


def written(result: dict[str, Any], out: str, started: float, reasons: dict[str, str]) -> Path:
    """A side suite's result, finished (the reason for each missed goal, the
    load at the end, the time taken) and written to ``out``."""
    for row in result["checks"]:
        if row["pass"] is False:
            row["reason"] = reason_for(row, result["mode"], {**load_reasons(), **reasons})
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = round(time.monotonic() - started, 1)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def table(result: dict[str, Any], software: str, digits: int = 0, after: str = "") -> str:
    """A side suite's README table: a line on the run (``software``: what it
    names besides the machine; ``after``: appended), then a row per check,
    times in ms with ``digits`` decimals."""
    m = result["machine"]
    lines = [
        f"Measured on {result['date'][:10]} ({result['mode']} mode) with "
        f"`{result['command']}`, on {m['cpu_model']}, {m['cpu_count']} CPUs, "
        f"{m['memory_bytes'] / GiB:.0f} GiB RAM, Linux {m['kernel']}, {software}, load "
        f"average {m['loadavg_start'][0]:.1f} at start and {m['loadavg_end'][0]:.1f} at "
        f"the end{after}.",
        "",
        "| | What | tensordepot (median) | Peer (median) | Measured | Goal | Result | Note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["checks"]:
        ours, peer = row["ours"], row["peer"]
        verdict = {True: "pass", False: "miss", None: "info"}[row["pass"]]
        goal = row["goal"].replace(">=", "≥").replace("<=", "≤") + "×" if row["goal"] else "—"
        lines.append(
            f"| {row['id']} | {row['what']} | {ours['median']:,.{digits}f} ms | "
            f"{peer['median']:,.{digits}f} ms ({peer['label']}) | "
            f"{row['measured']:.3g}× | {goal} | {verdict} | "
            f"{row['reason'] or row['note']} |"
        )
    return "\n".join(lines)


def teardown(broker: BrokerProc) -> dict[str, Any]:
    """Leftovers after the run: accounting, the exit status on SIGTERM, /dev/shm."""
    with broker.client() as c:
        names = [i.name for i in c.list()]
        for name in names:
            c.delete(name)

    def drained() -> Stat | None:
        st = broker.stat()
        return st if st.sessions <= 1 and st.leases == 0 else None  # <= 1: the probe itself

    st = wait_for(drained, 30, what="sessions and leases to drain")
    rc = broker.stop()
    left = broker.segments()
    return {
        "names_left": names,
        "bytes_in_use": st.bytes_in_use,
        "leases": st.leases,
        "exit_code": rc,
        "left_in_dev_shm": left,
        "clean": not names and st.bytes_in_use == 0 and rc == 0 and not left,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI)")
    ap.add_argument("--out", default="bench-results/bench.json", help="where to write the JSON")
    ap.add_argument("--shm-prefix", help="segment prefix of the broker this run starts")
    ap.add_argument("--only", help="comma-separated subset, e.g. B1,B3 (for development)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    _procs.settle_malloc()  # each step meets the peers at their best, whatever ran before
    only = {b.strip().upper() for b in args.only.split(",")} if args.only else None
    prefix = args.shm_prefix or f"tdbench-{secrets.token_hex(4)}-"
    command = (
        "python tests/bench/run.py" + (" --quick" if args.quick else "") + f" --out {args.out}"
    )
    started = time.monotonic()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": cfg.mode,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "config": asdict(cfg),
    }
    if cfg.mode == "quick":
        result["note"] = "quick mode: small sizes; the ratios only show that the suite runs"
    broker_args = [
        "--max-memory",
        cfg.max_memory,
        "--warm-memory",
        cfg.warm_memory,
        "--prealloc",
        cfg.prealloc,
        "--reap-interval",
        "0.5",
    ]
    result["broker"] = {"args": broker_args, "shm_prefix": prefix}
    peer = TorchPeer()  # first: it imports torch while the broker starts
    broker: BrokerProc | None = None
    bare_dir = tempfile.mkdtemp(prefix="tdbare-", dir="/tmp")  # AF_UNIX paths are short
    bare = BarePeer(bare_dir)  # starts alongside the broker
    benches: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
        if only is not None and name not in only:
            return
        print(f"[{time.monotonic() - started:5.1f} s] {name} ...", end=" ", flush=True)
        t0 = time.monotonic()
        data, rows = fn()
        data["seconds"] = round(time.monotonic() - t0, 2)
        benches[name] = data
        checks.extend(rows)
        print(f"{data['seconds']} s", flush=True)

    try:
        broker = BrokerProc(*broker_args, max_memory=cfg.max_memory, prefix=prefix)
        bare.wait_ready()
        with broker.client() as c:
            step("B1", lambda: bench_b1(c, cfg, peer))
            step("B2", lambda: bench_b2(c, cfg))
            step("B3", lambda: bench_b3(c, cfg, broker.url, peer))
            step("B4", lambda: bench_b4(c, cfg))
            step("B5", lambda: bench_b5(c, cfg, broker.url, bare.url))
            step("B7", lambda: bench_b7(c, cfg))
            step("B8", lambda: bench_b8(c, cfg, broker.url))
        step("B6", lambda: bench_b6(cfg, broker.url))
        step("B9", lambda: bench_b9(cfg, prefix))
        step("B10", lambda: bench_b10(cfg, broker.url))
        result["teardown"] = teardown(broker)
        print(f"[{time.monotonic() - started:5.1f} s] broker stopped", flush=True)
    except BaseException:
        if broker is not None and not broker.alive:
            print(f"\nthe broker died; its log:\n{broker.log()}", file=sys.stderr)
        raise
    finally:
        peer.close()
        bare.stop()
        shutil.rmtree(bare_dir, ignore_errors=True)
        if broker is not None:
            broker.cleanup()
    reasons = load_reasons()
    for row in checks:
        if row["pass"] is False:
            row["reason"] = reason_for(row, cfg.mode, reasons)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = round(time.monotonic() - started, 1)
    result["benchmarks"] = benches
    result["checks"] = checks
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"[{time.monotonic() - started:5.1f} s] wrote {out}")
    return 0


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'check':12} {'measured':>12} {'goal':>10}  result"]
    for row in result["checks"]:
        m = row["measured"]
        shown = "-" if m is None else f"{m:.3g} {row['unit']}"
        verdict = (
            "info"
            if row["goal_op"] == "info"
            else {True: "pass", False: "MISS", None: "n/a"}[row["pass"]]
        )
        lines.append(f"{row['id']:12} {shown:>12} {row['goal']:>10}  {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
