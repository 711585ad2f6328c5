"""Out of memory, against a real broker: a --max-memory below --segment-size
still stores what fits (its segments are sized to fit, and it says so), and
each reason a put is refused has its own message naming its own fix."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _hosts import Host, why_no_hosts
from tensordepot import OutOfMemory

MiB = 1 << 20


def test_a_max_memory_below_the_segment_size_still_stores_a_small_put(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    b = broker_factory(max_memory="64MiB")  # segments are 256 MiB by default
    assert (
        "--segment-size 256MiB is more than --max-memory 64MiB: segments are 16777216 "
        "bytes instead" in b.log()
    ), b.log()
    with b.client() as c:
        assert c.put("small", np.arange(256, dtype=np.float32)) == 1  # 1 KiB
        assert np.array_equal(np.from_dlpack(c.get("small")), np.arange(256, dtype=np.float32))
        c.delete("small")


def _refusal(c: object, name: str, nbytes: int) -> str:
    with pytest.raises(OutOfMemory) as err:
        c.put(name, np.zeros(nbytes, np.uint8))  # type: ignore[attr-defined]
    return str(err.value)


def test_each_cause_says_its_own_fix(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory("--segment-size", "32MiB", max_memory="56MiB")
    with b.client() as c:
        too_big = _refusal(c, "huge", 100 * MiB)
        assert "the tensor alone is larger than the limit" in too_big, too_big
        assert "--max-memory" in too_big and "--segment-size" not in too_big, too_big

        c.put_many({f"small{i}": np.zeros(12 * MiB, np.uint8) for i in range(2)})  # one segment
        # 32 MiB of 56 are left, but a new segment takes 32: the segment size is the fix
        segment = _refusal(c, "third", 12 * MiB)
        assert "a new segment takes 33554432 bytes" in segment, segment
        assert "a smaller --segment-size" in segment, segment

        c.put("alone", np.zeros(18 * MiB, np.uint8))  # above half a segment: its own
        full = _refusal(c, "more", 18 * MiB)
        assert "in use by live tensors" in full, full
        assert "free tensors with delete(), or start the broker with a larger --max-memory" in full
        assert "--segment-size" not in full, full
        c.delete_many(["small0", "small1", "alone"])
        wait_for(lambda: c.stat().bytes_in_use == 0, 10, what="the bytes freed")
        c.put("again", np.zeros(18 * MiB, np.uint8))
        c.delete("again")


@pytest.mark.skipif(bool(why_no_hosts()), reason=why_no_hosts() or "")
def test_a_full_dev_shm_is_named_as_the_cause(broker_factory: Callable[..., BrokerProc]) -> None:
    """/dev/shm smaller than --max-memory (a container's default 64 MiB):
    raising --max-memory would not help, and the message says what would."""
    host = Host(shm_size="16m")
    try:
        b = broker_factory(max_memory="1GiB", launcher=host.launcher, shm_dir=host.shm_dir)
        with b.client() as c:
            msg = _refusal(c, "w", 64 * MiB)
            assert (
                "/dev/shm (`df -h /dev/shm`; in docker compose, shm_size) itself is full" in msg
            ), msg
            assert "No space left on device" in msg and "larger --max-memory" not in msg, msg
            assert c.list() == [] and c.stat().bytes_in_use == 0
        b.check_clean()
        assert b.stop() == 0 and host.entries() == []
        b.expect_dead = True  # type: ignore[attr-defined]  # stopped, and checked, here
    finally:
        host.close()
