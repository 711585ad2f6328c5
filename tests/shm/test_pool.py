"""Unit tests of the shared-memory pool, on real segments in /dev/shm.

Every pool here has its own prefix; each test ends by closing its pools and
checking that nothing of that prefix is left in /dev/shm.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _harness import TEST_PREFIX, shm_entries
from tensordepot.shm import PosixSegment
from tensordepot.shm._pool import Block, Pool, PoolExhausted

MiB = 1 << 20
SEG = 1 * MiB  # pool segment size for these tests; dedicated above SEG // 2


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"{TEST_PREFIX}pool-{secrets.token_hex(4)}-"
    yield p
    left = shm_entries(p)
    for entry in left:
        os.unlink(os.path.join("/dev/shm", entry))
    assert left == [], f"the test left segments in /dev/shm: {left}"


@pytest.fixture
def make_pool(prefix: str) -> Iterator[Callable[..., Pool]]:
    pools: list[Pool] = []

    def make(sub: str = "", **kw: Any) -> Pool:
        kw.setdefault("max_memory", 64 * MiB)
        kw.setdefault("segment_size", SEG)
        pool = Pool(prefix + sub, **kw)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        assert pool.reserved == 0 and pool.segments == 0
    assert shm_entries(prefix) == [], "close() must unlink every segment"


def on_disk(pool: Pool) -> dict[str, int]:
    """The pool's segments as /dev/shm sees them: name -> size."""
    mine = re.compile(re.escape(pool.prefix) + "[0-9a-f]{32}")
    return {
        e: os.stat(f"/dev/shm/{e}").st_size for e in shm_entries(pool.prefix) if mine.fullmatch(e)
    }


def check_invariants(pool: Pool, live: list[Block]) -> None:
    """Accounting, bounds, and coalesced free lists."""
    segs = pool._segs
    assert on_disk(pool) == {name: s.size for name, s in segs.items()}
    assert pool.reserved == sum(s.size for s in segs.values()) <= pool.max_memory
    assert pool.used == sum(b.size for b in live)
    for name, s in segs.items():
        mine = sorted((b for b in live if b.segment == name), key=lambda b: b.offset)
        assert s.used == sum(b.size for b in mine)
        if s.dedicated:
            assert len(mine) <= 1 and s.free_off == []
            continue
        # Live blocks and free ranges tile the segment exactly.
        pieces = sorted(
            [(b.offset, b.size, "live") for b in mine]
            + [(o, n, "free") for o, n in zip(s.free_off, s.free_len, strict=True)]
        )
        pos = 0
        for off, size, _ in pieces:
            assert off == pos, f"gap or overlap at {off} in {name}: {pieces}"
            pos += size
        assert pos == s.size
        # Coalesced: two free ranges never touch, so there are at most
        # (live blocks + 1) of them and fragmentation stays bounded.
        kinds = [k for _, _, k in pieces]
        assert all(not (a == b == "free") for a, b in itertools.pairwise(kinds)), pieces
        assert len(s.free_off) <= len(mine) + 1


@pytest.mark.parametrize("align", [pytest.param(a, id=f"align{a}") for a in (64, 256, 4096)])
def test_blocks_are_aligned_and_disjoint(make_pool: Callable[..., Pool], align: int) -> None:
    pool = make_pool(align=align)
    sizes = [0, 1, align - 1, align, align + 1, 1000, 3 * align + 7, 10_000]
    blocks = [pool.alloc(n) for n in sizes]
    for b, n in zip(blocks, sizes, strict=True):
        assert b.offset % align == 0, b
        assert b.nbytes == n
        assert b.size >= max(n, 1) and b.size % align == 0, b
    check_invariants(pool, blocks)
    assert pool.segments == 1, "small blocks share one pool segment"


def test_freed_range_is_reused(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool()
    a, b = pool.alloc(10_000), pool.alloc(10_000)
    pool.free(a)
    c = pool.alloc(9_000)  # fits in a's warm range: first fit reuses it
    assert (c.segment, c.offset) == (a.segment, a.offset)
    assert pool.segments == 1
    check_invariants(pool, [b, c])


def test_free_ranges_coalesce(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool()
    blocks = [pool.alloc(4096) for _ in range(SEG // 4096)]  # fill the segment exactly
    assert pool.segments == 1
    seg = pool._segs[blocks[0].segment]
    assert seg.free_off == []
    rng = random.Random(7)
    rng.shuffle(blocks)
    live = list(blocks)
    for b in blocks:
        pool.free(b)
        live.remove(b)
        check_invariants(pool, live)
    assert (seg.free_off, seg.free_len) == ([0], [SEG]), "all free ranges merge back into one"
    whole = pool.alloc(SEG // 2)  # the largest pooled block fits only in the merged range
    assert whole.offset == 0 and whole.segment == seg.name


def test_a_batch_of_small_blocks_goes_back_to_back_and_frees_block_by_block(
    make_pool: Callable[..., Pool],
) -> None:
    pool = make_pool(align=256)
    pool.prewarm(SEG)
    first = pool.alloc(1000)  # the batch goes after it
    sizes = [1024, 0, 100, 5000, 1024]
    batch = pool.try_alloc_many(sizes)
    assert batch is not None
    assert [b.nbytes for b in batch] == sizes
    offsets = [b.offset for b in batch]
    assert offsets[0] == first.offset + first.size
    assert all(b.offset + b.size == nxt for b, nxt in zip(batch, offsets[1:], strict=False))
    check_invariants(pool, [first, *batch])
    for b in [batch[2], batch[0], *batch[3:], batch[1]]:  # freed one by one, in any order
        pool.free(b)
    check_invariants(pool, [first])
    seg = pool._segs[first.segment]
    assert len(seg.free_off) == 1, "the batch's ranges merged back"


def test_a_batch_that_fits_only_piece_by_piece_or_not_at_all(
    make_pool: Callable[..., Pool],
) -> None:
    pool = make_pool(align=4096)
    pool.prewarm(SEG)
    pieces = [pool.alloc(4096) for _ in range(SEG // 4096)]
    for b in pieces[::2]:  # every other page free: no range holds two pages
        pool.free(b)
    live = pieces[1::2]
    batch = pool.try_alloc_many([4096, 4096, 4096])
    assert batch is not None and len({b.offset for b in batch}) == 3
    check_invariants(pool, live + batch)
    free_pages = len(pieces) // 2 - 3
    before = (pool.used, list(pool._segs[live[0].segment].free_off))
    assert pool.try_alloc_many([4096] * (free_pages + 1)) is None, "more than there is"
    assert (pool.used, pool._segs[live[0].segment].free_off) == before, "nothing taken"
    for b in batch:
        pool.free(b)
    check_invariants(pool, live)


def test_random_churn_keeps_fragmentation_bounded(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(max_memory=8 * MiB)
    rng = random.Random(1234)
    live: list[Block] = []
    for step in range(600):
        if live and (rng.random() < 0.45 or pool.used > 5 * MiB):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.alloc(rng.choice([0, 1, 300, 4096, 50_000, 200_000])))
        if step % 20 == 0:
            check_invariants(pool, live)
    check_invariants(pool, live)
    for b in live:
        pool.free(b)
    check_invariants(pool, [])
    for s in pool._segs.values():
        assert s.used == 0 and len(s.free_off) == 1, "an empty segment is one free range"


def test_large_tensor_gets_a_dedicated_segment(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool()
    small = pool.alloc(1000)
    big = pool.alloc(3 * MiB + 5)
    assert big.offset == 0 and big.segment != small.segment
    assert on_disk(pool)[big.segment] == 4 * MiB, "dedicated segments are whole 2 MiB pages"
    assert pool._segs[big.segment].dedicated
    check_invariants(pool, [small, big])


def test_dedicated_segment_stays_warm_and_is_reused(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool()
    big = pool.alloc(4 * MiB)
    pool.free(big)
    assert big.segment in on_disk(pool), "freed memory stays warm within warm_bytes"
    again = pool.alloc(4 * MiB - 100)
    assert again.segment == big.segment, "a warm dedicated segment that fits is reused"
    pool.free(again)
    # Much smaller than the warm segment: it would waste most of it, so a new one is made.
    other = pool.alloc(2 * MiB)
    assert other.segment != big.segment
    check_invariants(pool, [other])


def test_free_memory_beyond_warm_bytes_is_unlinked(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(warm_bytes=2 * MiB)
    d1, d2 = pool.alloc(2 * MiB), pool.alloc(2 * MiB)
    pool.free(d1)
    assert d1.segment in on_disk(pool), "2 MiB free fits in warm_bytes"
    pool.free(d2)
    assert len([n for n, s in pool._segs.items() if s.dedicated]) == 1, "only 2 MiB stays warm"
    assert pool.warm_free() <= 2 * MiB
    check_invariants(pool, [])


def test_one_pool_segment_stays_warm(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(warm_bytes=0)
    blocks = [pool.alloc(SEG // 2) for _ in range(4)]  # two full pool segments
    big = pool.alloc(3 * MiB)
    assert pool.segments == 3
    for b in [*blocks, big]:
        pool.free(b)
    # warm_bytes=0 returns everything, except one pool segment so small puts stay fast.
    assert pool.segments == 1 and not next(iter(pool._segs.values())).dedicated
    check_invariants(pool, [])


def test_max_memory_raises_pool_exhausted(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(max_memory=4 * MiB)
    live = pool.alloc(4 * MiB)
    with pytest.raises(PoolExhausted, match="in use by live tensors"):
        pool.alloc(100)
    with pytest.raises(PoolExhausted, match="larger than the whole memory limit"):
        pool.alloc(5 * MiB)
    check_invariants(pool, [live])
    pool.free(live)
    pool.alloc(100)  # room again once the tensor is freed


def test_warm_free_memory_is_unlinked_before_failing(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(max_memory=6 * MiB)
    warm = pool.alloc(2 * MiB)
    pool.free(warm)  # 2 MiB warm + room for 4 MiB more
    assert warm.segment in on_disk(pool)
    fits = pool.alloc(6 * MiB)  # fits only if the warm segment goes first
    assert warm.segment not in on_disk(pool)
    check_invariants(pool, [fits])
    pool.free(fits)

    held = pool.alloc(4 * MiB)
    spare = pool.alloc(100)  # a pool segment...
    pool.free(spare)  # ...now wholly free and warm
    assert spare.segment in on_disk(pool)
    with pytest.raises(PoolExhausted):
        pool.alloc(4 * MiB)
    assert spare.segment not in on_disk(pool), "warm memory is returned before giving up"
    assert held.segment in on_disk(pool), "live data is never evicted"
    check_invariants(pool, [held])


def test_segment_creation_failure_is_pool_exhausted(make_pool: Callable[..., Pool]) -> None:
    def no_space(*args: Any, **kw: Any) -> PosixSegment:
        raise OSError(errno.ENOSPC, "No space left on device")

    pool = make_pool(segment_factory=no_space)
    with pytest.raises(PoolExhausted, match="could not create"):
        pool.alloc(10)
    assert pool.reserved == 0 and pool.used == 0


def test_prewarm_is_bounded_by_max_memory(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(max_memory=3 * MiB)
    pool.prewarm(10 * MiB)
    assert pool.segments == 3 and pool.reserved == 3 * MiB
    assert all(size == SEG for size in on_disk(pool).values())
    blocks = [pool.alloc(SEG // 2) for _ in range(6)]
    assert pool.segments == 3, "prewarmed segments are used before new ones are made"
    check_invariants(pool, blocks)


def test_segments_are_private_and_randomly_named(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool()
    blocks = [pool.alloc(3 * MiB) for _ in range(3)] + [pool.alloc(10)]
    names = {b.segment for b in blocks}
    assert len(names) == 4
    for name in names:
        assert re.fullmatch(re.escape(pool.prefix) + "[0-9a-f]{32}", name), name
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600


def test_double_free_and_foreign_blocks_are_refused(make_pool: Callable[..., Pool]) -> None:
    pool, other = make_pool(), make_pool("other-")
    b = pool.alloc(100)
    pool.free(b)
    with pytest.raises(ValueError, match="not live"):
        pool.free(b)
    foreign = other.alloc(100)
    with pytest.raises(ValueError, match="not live"):
        pool.free(foreign)
    check_invariants(pool, [])
    check_invariants(other, [foreign])


def test_close_unlinks_everything(make_pool: Callable[..., Pool], prefix: str) -> None:
    pool = make_pool()
    pool.alloc(100)
    pool.alloc(3 * MiB)
    warm = pool.alloc(2 * MiB)
    pool.free(warm)
    assert len(shm_entries(prefix)) == 3
    pool.close()
    assert shm_entries(prefix) == []
    assert (pool.reserved, pool.used, pool.segments) == (0, 0, 0)
    pool.close()  # idempotent


def test_a_segment_size_above_the_limit_is_cut_to_fit(make_pool: Callable[..., Pool]) -> None:
    pool = make_pool(max_memory=4 * MiB, segment_size=16 * MiB)
    assert pool.segment_size == MiB  # a quarter of the limit: several segments fit
    blocks = [pool.alloc(100) for _ in range(3)]
    check_invariants(pool, blocks)
    assert make_pool("tiny", max_memory=5000, segment_size=SEG).segment_size == 4096
