"""CUDA tensors through a real broker, between real processes, on a real GPU.

Every test here is ``@pytest.mark.cuda``: skipped (with the reason) where
there is no GPU, torch with CUDA, or cupy.  ``tests/gpu/run.sh`` runs them
on a GPU machine in one call, with ``TENSORDEPOT_REQUIRE_CUDA=1`` so that a
missing GPU fails the run instead of skipping it.

Workers are ``tests/workers/cuda_worker.py`` processes driven line by line;
the test process is a CUDA client too where that is simpler.  The last part
holds the GPU script's checks: each defect a close reading of the CUDA paths
found, tried where only a GPU can show it.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _workerio import Worker, metrics
from tensordepot import OutOfMemory
from tensordepot._wire import DeviceStat
from workers._cuda_data import expected

pytestmark = pytest.mark.cuda
torch = pytest.importorskip("torch")

kDLCPU, kDLCUDA = 1, 2
MiB = 1 << 20
DTYPES = ["float32", "bfloat16", "float16", "int64"]
BROKER_ARGS = ("--cuda-memory", "4GiB", "--cuda-segment-size", "64MiB")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_broker(broker_factory: Callable[..., BrokerProc]) -> BrokerProc:
    return broker_factory(*BROKER_ARGS)


@pytest.fixture
def cuda_worker(workers: Callable[..., Worker]) -> Callable[..., Worker]:
    """A ``cuda_worker`` of a broker, once it says it is ready."""
    return lambda url, env=None: workers(
        "cuda_worker", url, env=env, ready="ready", ready_timeout=120
    )


def ask(w: Worker, command: str, prefix: str, timeout: float = 120) -> str:
    w.send(command)
    got = w.line(timeout)
    assert got.startswith(prefix), f"{command!r} -> {got!r}\n{w.stderr()}"
    return got


def gpu_uuid() -> str:
    from tensordepot.shm import _cuda

    return str(_cuda.local_devices().uuid(0))


def device_stat(b: BrokerProc) -> DeviceStat:
    (dev,) = b.stat().devices
    return dev


def names(b: BrokerProc) -> set[str]:
    with b.client() as c:
        return {i.name for i in c.list()}


# -- exchange ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [pytest.param(d, id=d) for d in DTYPES])
def test_torch_producer_to_torch_and_cupy_consumers_bit_exact(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker], dtype: str
) -> None:
    producer = cuda_worker(gpu_broker.url)
    big = 20_000_000  # over half a 64 MiB segment for every dtype: a dedicated block
    ask(producer, f"put t {dtype} 100003 7", "put 1")
    ask(producer, f"put big {dtype} {big} 8", "put 1")
    ask(producer, "exit", "bye")
    producer.wait()  # gone, CUDA context and all, before anyone reads
    consumer = cuda_worker(gpu_broker.url)
    for lib in ("torch", "cupy", "both"):
        ask(consumer, f"check t {dtype} 100003 7 {lib}", "ok t v1")
        ask(consumer, f"check big {dtype} {big} 8 {lib}", "ok big v1")
    ask(consumer, f"check t {dtype} 100003 7 host", "ok t v1")
    with gpu_broker.client() as c:
        info = {i.name: i for i in c.list()}
    assert info["t"].device == f"cuda:{gpu_uuid()}", "TensorInfo names the GPU by UUID"


def test_the_bytes_survive_their_producer(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    producer = cuda_worker(gpu_broker.url)
    ask(producer, f"put w float32 {(128 * MiB) // 4} 3", "put 1")
    producer.kill()  # SIGKILL right after put returned: the copy was complete before publish
    producer.wait()
    consumer = cuda_worker(gpu_broker.url)
    ask(consumer, f"check w float32 {(128 * MiB) // 4} 3 torch", "ok w v1")


def test_cuda_visible_devices_as_uuid_and_as_index(
    broker_factory: Callable[..., BrokerProc], cuda_worker: Callable[..., Worker]
) -> None:
    uuid = gpu_uuid()
    b = broker_factory(*BROKER_ARGS, env={"CUDA_VISIBLE_DEVICES": uuid})
    by_uuid = cuda_worker(b.url, env={"CUDA_VISIBLE_DEVICES": uuid})
    by_index = cuda_worker(b.url, env={"CUDA_VISIBLE_DEVICES": "0"})
    for w in (by_uuid, by_index):
        seen = json.loads(ask(w, "devices", "devices ").split(" ", 1)[1])
        assert seen["uuids"] == [uuid] and seen["torch"] == 1
    ask(by_uuid, "put a bfloat16 5000 1", "put 1")
    ask(by_index, "check a bfloat16 5000 1 both", "ok a v1")
    ask(by_index, "put b int64 5000 2", "put 1")
    ask(by_uuid, "check b int64 5000 2 both", "ok b v1")


@pytest.mark.parametrize("env", ["0", "GPU", "GPU8", "0,0", "0,-1", "", "1", "-1", "junk"])
def test_the_visible_devices_model_matches_the_driver(env: str) -> None:
    from tensordepot.shm import _cuda
    from tensordepot.shm._device import visible_devices

    physical = _cuda.device_uuids()  # this process: CUDA_VISIBLE_DEVICES as the runner left it
    assert os.environ.get("CUDA_VISIBLE_DEVICES") is None, (
        "run the GPU tests with every GPU visible"
    )
    value = {"GPU": physical[0], "GPU8": physical[0][:12]}.get(env, env)
    code = "import json; from tensordepot.shm import _cuda; print(json.dumps(_cuda.device_uuids()))"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": value},
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == visible_devices(value, physical), value


# -- crossing devices, batches, empty ---------------------------------------------------------


def test_crossing_between_host_and_gpu(gpu_broker: BrokerProc) -> None:
    cupy = pytest.importorskip("cupy")
    host = np.arange(1 << 20, dtype=np.float32)
    with gpu_broker.client() as c:
        c.put("h2d", host, device="cuda")
        t = c.get("h2d")
        assert t.__dlpack_device__() == (kDLCUDA, 0) and t.device == "cuda:0"
        x = torch.from_dlpack(t)
        assert x.is_cuda and torch.equal(x.cpu(), torch.from_numpy(host))
        back = np.from_dlpack(t, device="cpu", copy=True)  # device to host, as a copy
        assert np.array_equal(back, host) and back.flags.writeable
        with pytest.raises(ValueError, match=r"np\.from_dlpack"):
            t.numpy()
        copied = cupy.from_dlpack(t.__dlpack__(stream=1, copy=True, max_version=(1, 1)))
        copied[0] = -1.0  # an independent copy: the published bytes do not change
        assert float(torch.from_dlpack(c.get("h2d"))[0].item()) == 0.0
        g = torch.arange(1000, dtype=torch.float64, device="cuda")[::2]  # strided, on the GPU
        c.put("d2h", g, device="cpu")
        assert c.get("d2h").device == "cpu"
        assert np.array_equal(np.from_dlpack(c.get("d2h")), g.cpu().numpy())
        c.put("d2d", g)  # stays on its GPU, stored contiguous
        assert torch.equal(torch.from_dlpack(c.get("d2d")), g)
        del t, x, copied


def test_put_many_and_get_many_of_a_gpu_state_dict(gpu_broker: BrokerProc) -> None:
    sd = {
        f"layer.{i}.{k}": (torch.randn(64, 33, device="cuda") * i).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(50)
        for k in ("w", "b", "n")
    }
    sd["cpu.extra"] = torch.arange(10)  # a CPU tensor in the same batch stays on the CPU
    with gpu_broker.client() as c:
        before = c.round_trips
        c.put_many(sd)
        got = c.get_many(list(sd))
        assert c.round_trips - before <= 3
        for k, v in sd.items():
            x = torch.from_dlpack(got[k])
            assert x.device == v.device and torch.equal(x, v), k
        del got, x


def test_gets_into_buffers_on_the_gpu_and_across_devices(gpu_broker: BrokerProc) -> None:
    """get(out=) where the source is on a GPU, into a GPU buffer and a host
    one, and from a host source into a GPU buffer; a mismatch writes nothing."""
    src = torch.arange(4096, device="cuda", dtype=torch.float32).reshape(64, 64)
    with gpu_broker.client() as c:
        c.put_many({"g": src, "h": src.cpu()})
        on_gpu, on_host = torch.zeros_like(src), torch.zeros(64, 64)
        assert c.get("g", out=on_gpu) is on_gpu and torch.equal(on_gpu, src)
        c.get("g", out=on_host)
        assert torch.equal(on_host, src.cpu())
        into_gpu = torch.zeros_like(src)
        got = c.get_many(["g", "h"], out={"h": into_gpu})
        assert got["h"] is into_gpu and torch.equal(into_gpu, src)
        wrong = torch.zeros(64, 64, device="cuda", dtype=torch.float16)
        with pytest.raises(Exception, match="float16"):
            c.get("g", out=wrong)
        assert not wrong.any()
        del got
        wait_for(lambda: c.stat().leases == 0, 30, what="the leases given back")
        c.delete_many(["g", "h"])


def test_empty_filled_on_a_stream_then_published(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    n = 1 << 20
    want = expected("float16", n, 4).cuda()
    with gpu_broker.client() as c:
        out = c.empty("filled", (n,), "float16", device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            view = torch.from_dlpack(out)  # exported on s
            torch.cuda._sleep(500_000_000)  # the fill is still queued when publish is called
            view.copy_(want)
        out.publish()  # waits for s's writes (not for the device)
        del view, out
    reader = cuda_worker(gpu_broker.url)
    ask(reader, f"check filled float16 {n} 4 both", "ok filled v1")


# -- lifetime on the GPU ---------------------------------------------------------------------


def test_sigkill_of_a_reader_then_its_block_is_reclaimed(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    with gpu_broker.client() as c:
        c.put("w", torch.ones(8 * MiB // 4, device="cuda"))
        reader = cuda_worker(gpu_broker.url)
        ask(reader, "hold w", "held 1")
        ask(reader, "export", "ok")
        c.put("w", torch.zeros(8 * MiB // 4, device="cuda"))  # v1 lives on for the reader only
        assert gpu_broker.stat().leases == 1
        reader.kill()
        reader.wait()
        wait_for(lambda: gpu_broker.stat().leases == 0, 10, what="the dead reader's lease to end")
        wait_for(lambda: device_stat(gpu_broker).bytes_pending == 0, 10, what="v1 to be reclaimed")
        dev = device_stat(gpu_broker)
        assert dev.bytes_in_use == 8 * MiB, "only v2 is held"
        c.put("w", torch.full((8 * MiB // 4,), 2.0, device="cuda"))
        assert device_stat(gpu_broker).bytes_reserved == dev.bytes_reserved, (
            "v1's memory was reused"
        )


def test_a_long_kernel_reading_a_released_tensor_sees_the_same_bytes(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    n = 4 * MiB // 4
    before = metrics(gpu_broker.url).get("tensordepot_cuda_frees_deferred_total", 0)
    with gpu_broker.client() as c:
        c.put("w", torch.full((n,), 1.0, device="cuda"))
        reader = cuda_worker(gpu_broker.url)
        ask(reader, "longread w 3000000000", "queued 1")  # ~1.5 s of sleep, then the sum
        c.put("w", torch.full((n,), 2.0, device="cuda"))  # v1 is retired; only the reader holds it
        wait_for(
            lambda: (
                metrics(gpu_broker.url).get("tensordepot_cuda_frees_deferred_total", 0) > before
            ),
            10,
            what="v1's release, with the reader's kernel still queued",
        )
        for value in (3.0, 4.0, 5.0):  # each put retires the last: v1's range would be reused now
            c.put("w", torch.full((n,), value, device="cuda"))
        assert ask(reader, "result", "sum ") == f"sum {float(n)}", "the kernel read v1's bytes"
        wait_for(lambda: device_stat(gpu_broker).bytes_pending == 0, 10, what="v1 to be freed")


def test_share_with_the_producer_alive_then_killed(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    producer = cuda_worker(gpu_broker.url)
    reader = cuda_worker(gpu_broker.url)
    ask(producer, "share s bfloat16 70001 5", "shared 1")
    ask(reader, "check s bfloat16 70001 5 both", "ok s v1")
    ask(reader, "hold s", "held 1")
    ask(reader, "export", "ok")
    producer.kill()
    producer.wait()
    t0 = time.monotonic()
    got = ask(reader, "export", "broken TensorBroken", timeout=30)
    assert time.monotonic() - t0 < 10, "no hang"
    assert "producer" in got
    ask(reader, "drop", "dropped")
    wait_for(
        lambda: "s" not in names(gpu_broker), 10, what="the name to be withdrawn with its producer"
    )


def test_share_close_waits_for_readers(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    producer = cuda_worker(gpu_broker.url)
    reader = cuda_worker(gpu_broker.url)
    ask(producer, "share s float32 4096 9", "shared 1")
    ask(reader, "hold s", "held 1")
    producer.send("close")
    with pytest.raises(AssertionError, match="no line"):
        producer.line(timeout=1.0)  # close() is waiting for the reader
    ask(reader, "drop", "dropped")
    assert producer.line(timeout=30).startswith("closed")


def test_nothing_on_the_gpu_until_used_and_stat_reports_it(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    b = broker_factory("--cuda-memory", "96MiB", "--cuda-segment-size", "16MiB")
    assert b.stat().devices == [], "a broker holds no GPU memory until a tensor goes there"
    with b.client() as c:
        c.put("cpu", np.ones(10))
        assert c.stat().devices == []
        c.put("g", torch.ones(40 * MiB // 4, device="cuda"))
        (dev,) = c.stat().devices
        assert dev.device == f"cuda:{gpu_uuid()}" and dev.max_memory == 96 * MiB
        assert dev.bytes_in_use == 40 * MiB
        print("broker CUDA context bytes:", dev.context_bytes)
        with pytest.raises(OutOfMemory, match="--cuda-memory"):
            c.put("g2", torch.ones(60 * MiB // 4, device="cuda"))
        c.put("cpu2", np.ones(1 << 20))  # the CPU is not affected
        m = metrics(b.url)
        assert m[f'tensordepot_memory_in_use_bytes{{device="cuda:{gpu_uuid()}"}}'] == 40 * MiB


def test_jax_reads_a_gpu_tensor(gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]) -> None:
    jax = pytest.importorskip("jax")
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if not has_gpu:
        pytest.skip("jax has no GPU backend here")
    producer = cuda_worker(gpu_broker.url)
    ask(producer, "put j float32 4096 11", "put 1")
    reader = cuda_worker(gpu_broker.url, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    ask(reader, "check j float32 4096 11 jax", "ok j v1")


# -- the GPU script's checks: each defect a close reading of the CUDA paths found ---------


def test_share_then_get_in_the_same_process_gives_its_own_pointer(gpu_broker: BrokerProc) -> None:
    """CUDA refuses to open an IPC handle in the process that exported it."""
    with gpu_broker.client() as c:
        x = torch.arange(4096, dtype=torch.float32, device="cuda")
        c.share("own", x)
        t = c.get("own")
        y = torch.from_dlpack(t)
        assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)
        del y, t
        c.delete("own")


def test_torch_from_dlpack_to_the_cpu(gpu_broker: BrokerProc) -> None:
    """torch names its CUDA stream with a CPU dl_device: the copy runs there."""
    with gpu_broker.client() as c:
        x = torch.arange(70001, dtype=torch.float32, device="cuda").to(torch.bfloat16)
        c.put("h", x)
        t = c.get("h")
        y = torch.from_dlpack(t, device="cpu")
        assert y.device.type == "cpu" and y.dtype == torch.bfloat16
        assert torch.equal(y.view(torch.int16), x.cpu().view(torch.int16))
        del y, t
        c.delete("h")


def test_a_producer_that_closes_but_lives_on_leaves_its_readers_broken_not_wrong(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    producer = cuda_worker(gpu_broker.url)
    reader = cuda_worker(gpu_broker.url)
    ask(producer, "share s float32 1000000 5 0.5", "shared 1")
    ask(reader, "hold s", "held 1")
    ask(reader, "export", "ok")
    ask(producer, "close", "closed", timeout=30)  # waits 0.5 s for the reader, then withdraws
    ask(producer, "reuse 1000000", "reused")  # its allocator hands the memory to new tensors
    got = ask(reader, "export", "broken TensorBroken", timeout=30)
    assert "withdrawn" in got
    ask(reader, "drop", "dropped")


def test_close_with_a_long_kernel_still_queued_keeps_the_memory_mapped(
    gpu_broker: BrokerProc, cuda_worker: Callable[..., Worker]
) -> None:
    n = 4 * MiB // 4
    with gpu_broker.client() as c:
        c.put("w", torch.full((n,), 1.0, device="cuda"))
        reader = cuda_worker(gpu_broker.url)
        ask(reader, "longread w 3000000000", "queued 1")  # ~1.5 s of sleep, then the sum
        ask(reader, "close", "closed")  # drops the cache's hold on every block it opened
        c.put("w", torch.full((n,), 2.0, device="cuda"))
        assert ask(reader, "result", "sum ") == f"sum {float(n)}"
        c.delete("w")


def test_ipc_handles_are_stable_per_allocation_and_never_repeat() -> None:
    import cupy
    from tensordepot.shm import _cuda

    rt = cupy.cuda.runtime
    with _cuda.on_device(0):
        block = rt.malloc(1 << 20)
        try:
            assert bytes(rt.ipcGetMemHandle(block)) == bytes(rt.ipcGetMemHandle(block))
        finally:
            rt.free(block)
    events = [_cuda.IpcEvent(0) for _ in range(1000)]
    try:
        assert len({e.handle for e in events}) == 1000
    finally:
        for e in events:
            e.destroy()


def test_cupy_on_per_thread_default_streams(gpu_broker: BrokerProc) -> None:
    import cupy

    with gpu_broker.client() as c:
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        c.put("p", x)
        t = c.get("p")
        with cupy.cuda.Stream.ptds:
            y = cupy.from_dlpack(t)  # exported on stream 2, this thread's own
            total = float(y.sum())
        assert total == float(x.double().sum())
        assert t._streams.streams == {1}, "released on the legacy stream, which waits for ptds"
        del y, t
        gc.collect()
        c.delete("p")


def test_bfloat16_through_cupy_and_jax(gpu_broker: BrokerProc) -> None:
    import cupy

    with gpu_broker.client() as c:
        x = torch.arange(4096, device="cuda").to(torch.bfloat16)
        c.put("b", x)
        t = c.get("b")
        y = cupy.from_dlpack(t)
        assert str(y.dtype) == "bfloat16"
        assert bytes(y.view(cupy.uint16).get()) == bytes(x.cpu().view(torch.int16).numpy())
        copied = torch.from_dlpack(t.__dlpack__(max_version=(1, 0), copy=True))
        assert torch.equal(copied, x) and copied.data_ptr() != x.data_ptr()
        jax = pytest.importorskip("jax")
        z = jax.dlpack.from_dlpack(t)
        assert str(z.dtype) == "bfloat16"
        del y, t, z, copied
        c.delete("b")


def _gpu_used() -> int:
    """Bytes in use on GPU 0, every process together (per-process figures
    are missing where nvidia-smi cannot see other processes, in containers)."""
    free, total = torch.cuda.mem_get_info(0)
    return int(total - free)


def test_dropping_warm_blocks_a_client_still_maps_stays_within_cuda_memory(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """The pool drops warm blocks for new sizes while the reader's process
    still maps them: each is held (counted against --cuda-memory) until the
    reader's client says it no longer maps it, so a put may wait, but the GPU
    never holds more than the limit (and the broker's context)."""
    b = broker_factory("--cuda-memory", "512MiB", "--cuda-segment-size", "64MiB")
    limit = 512 * MiB
    torch.ones(1, device="cuda")  # this process's own context, before the baseline
    baseline = _gpu_used()
    with b.client() as c, b.client() as r:

        def put(name: str, x: Any) -> bool:
            try:
                c.put(name, x)
                return True
            except OutOfMemory:  # blocks the reader still maps are held: wait for its check
                return False

        # The broker's context (NVML's figure, else a generous guess), this
        # process's allocator cache of the tensors it puts, and the driver's rounding.
        slack = 2 * 60 * MiB + 64 * MiB
        for size in (60, 30, 15, 60, 45):  # each round needs blocks of another size
            names = [f"w{size}-{i}" for i in range(512 // 64)]
            for n in names:
                x = torch.ones(size * MiB // 4, device="cuda")
                wait_for(lambda n=n, x=x: put(n, x), 90, what=f"room for {n}")
                y = torch.from_dlpack(r.get(n))  # the reader maps the block, and caches it
                del y
                (dev,) = c.stat().devices
                assert dev.bytes_reserved <= limit, dev
                context = dev.context_bytes or 1024 * MiB
                assert _gpu_used() - baseline <= limit + context + slack, dev
            for n in names:
                c.delete(n)


def test_the_gpu_benchmarks_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu-bench.json"
    t0 = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "gpu" / "bench.py"),
            "--size",
            str(64 * MiB),
            "--out",
            str(out),
        ],
        check=True,
        timeout=150,
    )
    result = json.loads(out.read_text())
    assert not result["errors"], result["errors"]
    assert {r["id"].split(".")[0] for r in result["rows"]} == {"G1", "G2", "G3", "G4"}
    print(f"G1..G4 at 64 MiB in {time.monotonic() - t0:.0f} s")
