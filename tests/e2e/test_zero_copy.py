"""Zero copy, shown: big gets add no anonymous memory, and readers cannot change
what others read."""

from __future__ import annotations

import gc
import os
import re
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, run_worker, spawn_worker

GiB = 1 << 30


def test_1gib_get_and_full_read_adds_no_anonymous_memory(  # type: ignore[no-untyped-def]
    broker_factory,
) -> None:
    b = broker_factory(max_memory="3GiB")
    with b.client() as c:
        out = c.empty("big", (GiB // 4,), "float32")  # filled in place: no copy on our side either
        np.from_dlpack(out).fill(1.0)
        out.publish()
        del out
        res = run_worker("zero_copy_reader", b.url, "big", timeout=300)
        m = re.search(
            r"nbytes=(\d+) pages_sum=([\d.]+) expected=([\d.]+) anon_growth_kib=(-?\d+)", res.stdout
        )
        assert m, res.stdout
        nbytes, got, want, growth_kib = int(m[1]), float(m[2]), float(m[3]), int(m[4])
        assert nbytes == GiB
        assert got == want, "the reader saw other bytes than the producer wrote"
        assert growth_kib < 64 * 1024, f"reading 1 GiB grew anonymous memory by {growth_kib} KiB"
        print(f"\n1 GiB get + full read: anonymous memory grew {growth_kib} KiB")


def test_torch_write_to_published_tensor_stays_in_the_writer(broker: BrokerProc) -> None:
    """torch ignores the read-only flag: its in-place write must neither kill the
    writing process nor reach any other reader (copy-on-write reader mappings)."""
    want = np.arange(1000, dtype=np.float32)
    with broker.client() as c:
        c.put("ro", want)
        held = np.from_dlpack(c.get("ro"))  # another reader, holding a view during the write
        w = spawn_worker("write_through_torch", broker.url, "ro")
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, (w.returncode, out, err[-2000:])
        assert "WROTE" in out and "CLEAN" in out, (out, err)
        assert held.tobytes() == want.tobytes(), (
            "a stray write in one process changed another's view"
        )
        got = np.from_dlpack(c.get("ro"))
        assert got.tobytes() == want.tobytes(), "a stray write reached the published bytes"
        del got, held


def _present(ptr: int, nbytes: int) -> int:
    """How many pages of ``[ptr, ptr + nbytes)`` this process has page
    tables for, read from /proc/self/pagemap without touching them."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(ptr // page * 8)
        e = np.frombuffer(f.read(-(-nbytes // page) * 8), dtype="<u8")
    return int(((e >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.parametrize("batch", [False, True], ids=["get", "get_many"])
def test_a_torch_write_never_reaches_a_later_get_in_the_same_process(
    broker: BrokerProc, batch: bool
) -> None:
    """Reads go through a mapping kept across gets, so a second get of 64 MiB
    finds its page tables made.  A torch write into the first view stays in
    that view while it is held, and is gone once it is released: the same
    tensor got again shows the published bytes."""
    torch = pytest.importorskip("torch")
    n = 16 << 20  # 64 MiB of float32
    want = np.arange(n, dtype=np.float32)

    def get() -> tuple[Any, Any]:
        st = c.get_many(["w"])["w"] if batch else c.get("w")
        return st, torch.from_dlpack(st)

    with broker.client() as c:
        c.put("w", want)
        st, t = get()
        assert torch.equal(t, torch.from_numpy(want))  # reads every page
        t.mul_(-1.0)  # torch ignores the read-only flag
        held_st, held = get()  # the first view is held: this one maps apart
        assert torch.equal(held, torch.from_numpy(want)), "a held view's write reached a new get"
        assert float(t[1]) == -1.0, "the writer's own view lost its write"
        ptr = t.data_ptr()
        del st, t, held_st, held
        gc.collect()
        st, t = get()
        assert torch.equal(t, torch.from_numpy(want)), "a released view's write reached a later get"
        del st, t
        gc.collect()
        st = c.get("w")
        t = torch.from_dlpack(st)
        assert t.data_ptr() == ptr
        assert _present(ptr, n * 4) == n * 4 // os.sysconf("SC_PAGE_SIZE"), (
            "a later get mapped afresh: its page tables were not kept"
        )
        del st, t


def test_numpy_write_to_published_tensor_raises(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("ro", np.arange(10, dtype=np.int64))
        a = np.from_dlpack(c.get("ro"))
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 5
        n = c.get("ro").numpy()
        with pytest.raises(ValueError, match="read-only"):
            n += 1
        del a, n
