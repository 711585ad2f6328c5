"""A lane's memory and bells (shm/_lanemem.py): made by one side, passed
over a unix socket as SCM_RIGHTS, checked and mapped by the other; records
cross both ways and each bell wakes its side; anything that is not a lane
is refused with its descriptors closed, and nothing leaks."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import tempfile
import threading

import pytest
from tensordepot.shm._lanemem import (
    BROKER,
    CLIENT,
    MAGIC,
    PAGE,
    LaneMemory,
    LaneRefused,
    lane_bytes,
)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _passed(fds: list[int]) -> list[int]:
    """``fds`` sent over a real unix socket pair, as the broker sends them."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        socket.send_fds(a, [b"lane"], fds)
        msg, got, _, _ = socket.recv_fds(b, 16, 8)
        assert msg == b"lane"
        return got


def test_a_lane_made_and_passed_carries_records_both_ways_with_its_bells() -> None:
    before = _open_fds()
    broker = LaneMemory.create(4096, 8192)
    client = LaneMemory.adopt(_passed(broker.fds()))
    assert client.sizes == (4096, 8192)
    assert client.requests.put(b"stat")  # type: ignore[union-attr]
    client.ring(BROKER)
    assert broker.wait(BROKER, 5.0)
    assert broker.requests.take() == b"stat"  # type: ignore[union-attr]
    assert broker.answers.put(b"answer")  # type: ignore[union-attr]
    broker.ring(CLIENT)
    assert client.wait(CLIENT, 5.0)
    assert client.answers.take() == b"answer"  # type: ignore[union-attr]
    assert not client.wait(CLIENT, 0.01), "a bell rings once per ring"
    assert broker.drain(BROKER) == 0
    client.close()
    broker.close()
    broker.close()  # idempotent
    assert _open_fds() == before


def test_a_bell_wakes_a_waiting_thread() -> None:
    broker = LaneMemory.create(4096, 4096)
    client = LaneMemory.adopt(_passed(broker.fds()))
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(client.wait(CLIENT, 10.0)))
    t.start()
    broker.ring(CLIENT)
    t.join(10)
    assert woke == [True]
    client.close()
    broker.close()


def test_the_memory_is_sealed_and_has_no_name() -> None:
    broker = LaneMemory.create(4096, 4096)
    memfd = broker.fds()[0]
    with pytest.raises(PermissionError):
        os.ftruncate(memfd, 1)  # sealed: a mapping never faults past its end
    assert os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:tensordepot-lane")
    assert not any("tensordepot-lane" in n for n in os.listdir("/dev/shm"))
    broker.close()


def _memfd(size: int, head: bytes, seals: int) -> int:
    fd = os.memfd_create("not-a-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, head, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _bells() -> list[int]:
    return [os.eventfd(0, os.EFD_CLOEXEC) for _ in range(2)]


SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
GOOD = struct.pack("<8sIII", MAGIC, 1, 4096, 4096)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: [_memfd(lane_bytes(4096, 4096), GOOD, SEALED)], "3 descriptors"),
        (lambda: [_memfd(lane_bytes(4096, 4096), GOOD, 0), *_bells()], "not sealed"),
        (
            lambda: [_memfd(lane_bytes(4096, 4096), b"TDLANE99" + GOOD[8:], SEALED), *_bells()],
            "layout",
        ),
        (
            lambda: [
                _memfd(
                    lane_bytes(4096, 4096), struct.pack("<8sIII", MAGIC, 1, 4096, 1 << 20), SEALED
                ),
                *_bells(),
            ],
            "rings of",
        ),
        (
            lambda: [
                _memfd(lane_bytes(4096, 4096), struct.pack("<8sIII", MAGIC, 1, 4096, 100), SEALED),
                *_bells(),
            ],
            "power of two",
        ),
        (lambda: [_memfd(PAGE - 8, b"", SEALED), *_bells()], "bytes"),
        (
            lambda: [
                _memfd(lane_bytes(4096, 4096), GOOD, SEALED),
                os.eventfd(0, os.EFD_CLOEXEC),
                os.dup(0),
            ],
            "eventfd",
        ),
    ],
)
def test_what_is_not_a_lane_is_refused_and_closed(make: object, says: str) -> None:
    before = _open_fds()
    fds = make()  # type: ignore[operator]
    with pytest.raises(LaneRefused, match=says):
        LaneMemory.adopt(_passed(fds))
    for f in fds:
        os.close(f)
    assert _open_fds() == before, "the passed descriptors were all closed"


def test_a_regular_file_is_not_a_lane() -> None:
    before = _open_fds()
    with tempfile.TemporaryFile() as f:
        f.write(GOOD.ljust(lane_bytes(4096, 4096), b"\0"))
        f.flush()
        fds = [os.dup(f.fileno()), *_bells()]
        with pytest.raises(LaneRefused, match="not a memfd"):
            LaneMemory.adopt(_passed(fds))
        for x in fds:
            os.close(x)
    assert _open_fds() == before


def test_a_reader_without_room_for_the_descriptors_gets_none_and_none_leak() -> None:
    """A client that reads the handover with a plain recv: the kernel closes
    the descriptors it was not given room for."""
    broker = LaneMemory.create(4096, 4096)
    before = _open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        socket.send_fds(a, [b"lane"], broker.fds())
        assert b.recv(16) == b"lane"
        assert _open_fds() == before + 2  # only the pair itself
    broker.close()
