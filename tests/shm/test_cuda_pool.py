"""The pool logic over the CUDA segment kind's interface, without a GPU.

The broker keeps one ``Pool`` per GPU whose segments are CUDA blocks
(``shm/_cuda.py``'s ``CudaBlock``).  The pool is ours and runs here as it
runs on a GPU; ``FakeBlock`` stands in for the GPU: it has the Segment
protocol's fields plus the IPC handle, and records what was allocated and
freed so the tests can see every cudaMalloc and cudaFree the pool causes.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator

import pytest
from tensordepot.shm._base import Segment
from tensordepot.shm._cuda import KIND
from tensordepot.shm._pool import Block, Pool, PoolExhausted

MiB = 1 << 20
SEG = 4 * MiB
DEVICE = "cuda:GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


class FakeBlock:
    """One 'cudaMalloc': the Segment protocol plus an IPC handle."""

    kind = KIND

    def __init__(self, gpu: FakeGpu, name: str, size: int, **posix_options: object) -> None:
        self.gpu, self.name, self.size = gpu, name, size
        self.ipc_handle = os.urandom(64)
        self.freed = False
        gpu.live[name] = self

    def unlink(self) -> None:
        assert not self.freed, f"{self.name} freed twice"
        self.freed = True
        del self.gpu.live[self.name]
        self.gpu.frees += 1


class FakeGpu:
    def __init__(self, fail_after: int | None = None) -> None:
        self.live: dict[str, FakeBlock] = {}
        self.mallocs = 0
        self.frees = 0
        self.fail_after = fail_after

    def factory(self, name: str, size: int, **posix_options: object) -> Segment:
        if self.fail_after is not None and self.mallocs >= self.fail_after:
            raise OSError(12, "cudaMalloc: out of memory")
        self.mallocs += 1
        return FakeBlock(self, name, size, **posix_options)


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()


@pytest.fixture
def make_pool(gpu: FakeGpu) -> Iterator[Callable[..., Pool]]:
    pools: list[Pool] = []

    def make(**kw: object) -> Pool:
        kw.setdefault("max_memory", 64 * MiB)
        kw.setdefault("segment_size", SEG)
        pool = Pool("tdtest-cuda-", segment_factory=gpu.factory, device=DEVICE, **kw)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
    assert gpu.live == {}, "close() must free every block"


def check(pool: Pool, live: list[Block], gpu: FakeGpu) -> None:
    """Accounting, device stamps, bounds, and that live ranges never overlap."""
    assert set(pool.segment_names()) == set(gpu.live)
    assert pool.reserved == sum(b.size for b in gpu.live.values()) <= pool.max_memory
    assert pool.used == sum(b.size for b in live)
    for b in live:
        assert b.device == DEVICE
        assert b.offset % pool.align == 0
        assert b.offset + b.size <= gpu.live[b.segment].size
    for a, c in itertools.combinations(live, 2):
        if a.segment == c.segment:
            assert a.offset + a.size <= c.offset or c.offset + c.size <= a.offset, (a, c)


def test_nothing_is_allocated_until_first_used(
    make_pool: Callable[..., Pool], gpu: FakeGpu
) -> None:
    pool = make_pool()
    assert gpu.mallocs == 0 and pool.reserved == 0
    b = pool.alloc(1000)
    assert gpu.mallocs == 1 and pool.segments == 1
    check(pool, [b], gpu)


def test_small_tensors_share_one_block_and_reuse_freed_ranges(
    make_pool: Callable[..., Pool], gpu: FakeGpu
) -> None:
    pool = make_pool()
    blocks = [pool.alloc(n) for n in (1, 255, 256, 257, 10_000, 0)]
    assert gpu.mallocs == 1, "small tensors are ranges of one cudaMalloc"
    check(pool, blocks, gpu)
    victim = blocks.pop(4)
    pool.free(victim)
    again = pool.alloc(9_000)
    assert (again.segment, again.offset) == (victim.segment, victim.offset), (
        "the warm range is reused"
    )
    assert gpu.mallocs == 1 and gpu.frees == 0
    check(pool, [*blocks, again], gpu)


def test_large_tensors_get_a_dedicated_block_that_stays_warm(
    make_pool: Callable[..., Pool], gpu: FakeGpu
) -> None:
    pool = make_pool()
    big = pool.alloc(3 * MiB + 5)  # above segment_size / 2
    assert big.offset == 0 and big.size == 4 * MiB, "dedicated blocks round to 2 MiB"
    assert gpu.live[big.segment].size == 4 * MiB
    pool.free(big)
    assert gpu.frees == 0, "freed device memory stays allocated for the next put"
    again = pool.alloc(3 * MiB)
    assert again.segment == big.segment and gpu.mallocs == 1
    check(pool, [again], gpu)


def test_the_per_gpu_limit_is_507_material_and_warm_memory_gives_way(
    make_pool: Callable[..., Pool], gpu: FakeGpu
) -> None:
    pool = make_pool(max_memory=16 * MiB)
    a = pool.alloc(6 * MiB)
    b = pool.alloc(6 * MiB)
    with pytest.raises(PoolExhausted, match="in use by live tensors"):
        pool.alloc(6 * MiB)
    pool.free(b)  # warm, but no longer live: quota pressure frees it
    c = pool.alloc(8 * MiB)
    assert gpu.frees == 1 and pool.reserved <= 16 * MiB
    check(pool, [a, c], gpu)
    with pytest.raises(PoolExhausted, match="larger than the whole memory limit"):
        pool.alloc(32 * MiB)


def test_a_failed_cudamalloc_is_pool_exhausted_naming_cuda() -> None:
    failing = FakeGpu(fail_after=0)
    factory = functools.partial(failing.factory)
    factory.kind = KIND  # type: ignore[attr-defined]  # as the broker labels its CUDA factories
    pool = Pool(
        "tdtest-cuda-",
        max_memory=64 * MiB,
        segment_size=SEG,
        segment_factory=factory,
        device=DEVICE,
    )
    try:
        with pytest.raises(PoolExhausted, match="could not create a 4194304 byte CUDA segment"):
            pool.alloc(100)
        assert pool.reserved == 0 and pool.segments == 0
    finally:
        pool.close()


def test_close_frees_every_block_once(make_pool: Callable[..., Pool], gpu: FakeGpu) -> None:
    pool = make_pool()
    live = [pool.alloc(n) for n in (100, 3 * MiB, 5 * MiB, 1000)]
    check(pool, live, gpu)
    made = gpu.mallocs
    pool.close()
    assert gpu.frees == made and gpu.live == {} and pool.reserved == 0


def test_on_drop_names_each_block_the_pool_frees(
    make_pool: Callable[..., Pool], gpu: FakeGpu
) -> None:
    pool = make_pool(max_memory=8 * MiB, warm_bytes=0)
    dropped: list[str] = []
    pool.on_drop = dropped.append
    a = pool.alloc(3 * MiB)
    name = a.segment
    pool.free(a)
    assert dropped == [name] and name not in gpu.live, (
        "with no warm budget, a free block goes at once"
    )
