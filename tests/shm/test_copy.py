"""The parallel copy's promise (shm/_copy.py): once ``copy_into`` or
``copy_many`` raises, no copy thread writes into the destination any more, so
the caller may give that memory back at once (M1).

A Ctrl-C lands wherever the interpreter happens to be.  These tests make it
land in the worst place found so far, between two ``submit`` calls, when the
first piece already runs and its future is not yet known to anyone
(tests/_interrupt.py).  Then every copy thread is drained and the
destination must be as it was when the call raised."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _interrupt import interrupt_at
from tensordepot.shm import _copy

pytestmark = pytest.mark.skipif(_copy._threads < 2, reason="one copy thread: nothing runs aside")

MiB = 1 << 20


def _drain() -> None:
    """Wait until every copy thread has finished what it was given before."""
    pool = _copy._pool()
    started = threading.Barrier(_copy._threads + 1)
    done = [pool.submit(started.wait, 60) for _ in range(_copy._threads)]
    started.wait(60)
    for f in done:
        f.result(60)


@pytest.fixture
def interrupted_at_second_submit() -> Iterator[None]:
    _drain()  # the pool exists, its threads are idle
    with interrupt_at(ThreadPoolExecutor.submit.__code__, 2):
        yield


def _big_strided(mib: int) -> np.ndarray:
    """A non-contiguous float32 source of ``mib`` MiB (a transpose: a slow copy)."""
    n = mib * MiB // 4
    side = int(n**0.5)
    return np.full((side, n // side), 5.0, dtype=np.float32).T


def test_an_interrupt_between_submits_leaves_no_copy_writing(
    interrupted_at_second_submit: None,
) -> None:
    src = _big_strided(128)
    dst = np.zeros(src.shape, dtype=np.float32)
    with pytest.raises(KeyboardInterrupt):
        _copy.copy_into(dst, src)
    when_raised = dst.copy()
    _drain()
    assert np.array_equal(dst, when_raised), "a copy thread wrote after copy_into raised"


def test_an_interrupt_between_submits_of_a_batch_leaves_no_copy_writing(
    interrupted_at_second_submit: None,
) -> None:
    srcs = [_big_strided(64), _big_strided(64)]
    dsts = [np.zeros(s.shape, dtype=np.float32) for s in srcs]
    with pytest.raises(KeyboardInterrupt):
        _copy.copy_many(list(zip(dsts, srcs, strict=True)))
    when_raised = [d.copy() for d in dsts]
    _drain()
    for d, w in zip(dsts, when_raised, strict=True):
        assert np.array_equal(d, w), "a copy thread wrote after copy_many raised"


def test_an_interrupt_while_this_thread_copies_its_run_leaves_no_copy_writing() -> None:
    """copy_many of tensors too small to split copies its first run in the
    calling thread: a Ctrl-C there, between two of its copies, stops that
    thread where it is and the copy threads after their current tensor."""
    _drain()
    srcs = [_big_strided(4) for _ in range(40)]  # each under _MIN_PARALLEL: two runs of 20
    dsts = [np.zeros(s.shape, dtype=np.float32) for s in srcs]
    with interrupt_at(_copy._copy.__code__, 3), pytest.raises(KeyboardInterrupt):
        _copy.copy_many(list(zip(dsts, srcs, strict=True)))
    when_raised = [d.copy() for d in dsts]
    _drain()
    for d, w in zip(dsts, when_raised, strict=True):
        assert np.array_equal(d, w), "a copy thread wrote after copy_many raised"
    assert np.all(dsts[0] == 5.0) and np.all(dsts[1] == 5.0), "this thread copied two first"
    assert not any(d.any() for d in dsts[2:20]), "this thread went on after the interrupt"


def test_a_copy_that_is_not_interrupted_copies_everything() -> None:
    src = _big_strided(64)
    dst = np.zeros(src.shape, dtype=np.float32)
    _copy.copy_into(dst, src)
    assert np.array_equal(dst, src)
    pairs = [
        (np.zeros(s.shape, dtype=np.float32), s)
        for s in [_big_strided(16), np.arange(1000, dtype=np.float32), _big_strided(9)]
    ]
    _copy.copy_many(pairs)
    assert all(np.array_equal(d, s) for d, s in pairs)


@pytest.mark.parametrize(
    "sizes",
    [
        [1, 1, 1, 1, 7],
        [7, 1],
        [3, 3, 2, 2, 2],
        [1, 10, 1],
        [5] * 7,
        [2_621_440, 30_720, 30_720] * 100,  # B7's state dict: in order, a weight then two small
        [int(x) for x in np.random.default_rng(7).integers(1, 1 << 20, 500)],
    ],
)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_batch_is_cut_in_order_into_runs_of_about_equal_bytes(sizes: list[int], n: int) -> None:
    pairs = [(np.empty(k, np.uint8), np.empty(k, np.uint8)) for k in sizes]
    runs = _copy._runs(pairs, n)
    assert [p for run in runs for p in run] == pairs  # every pair, once, in order
    assert 1 <= len(runs) <= n and all(runs)
    share = sum(sizes) / n
    done = 0.0
    for k, run in enumerate(runs):
        for i, (d, _) in enumerate(run):
            middle = done + d.nbytes / 2
            if i == 0 and k > 0:  # it starts a run: most of it lies past the runs before
                assert middle > share * k, (k, middle, share)
            elif i > 0 and k < n - 1:  # it joined its run: most of it lies within the share
                assert middle <= share * (k + 1), (k, middle, share)
            done += d.nbytes
