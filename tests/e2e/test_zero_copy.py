"""Zero copy, shown: big gets add no anonymous memory, and readers cannot change
what others read."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _harness import BrokerProc, run_worker, spawn_worker

GiB = 1 << 30


def test_1gib_get_and_full_read_adds_no_anonymous_memory(  # type: ignore[no-untyped-def]
        broker_factory) -> None:
    b = broker_factory(max_memory="3GiB")
    with b.client() as c:
        out = c.empty("big", (GiB // 4,), "float32")  # filled in place: no copy on our side either
        np.from_dlpack(out).fill(1.0)
        out.publish()
        del out
        res = run_worker("zero_copy_reader", b.url, "big", timeout=300)
        m = re.search(r"nbytes=(\d+) pages_sum=([\d.]+) expected=([\d.]+) anon_growth_kib=(-?\d+)",
                      res.stdout)
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
            "a stray write in one process changed another's view")
        got = np.from_dlpack(c.get("ro"))
        assert got.tobytes() == want.tobytes(), "a stray write reached the published bytes"
        del got, held


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
