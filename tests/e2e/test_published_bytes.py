"""Published bytes never change: not through a writer thread still writing
while ``publish()`` runs, and not through a reader's stray writes when its
memory is locked (``mlockall``)."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _workerio import Worker


def _write_until(a: np.ndarray, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        a[0] = i
        i += 1


@pytest.mark.parametrize(
    "nbytes", [pytest.param(8 << 10, id="8KiB"), pytest.param(8 << 20, id="8MiB")]
)
def test_a_writer_thread_racing_publish_never_changes_what_a_reader_got(
    broker: BrokerProc, nbytes: int
) -> None:
    """The writer's window turns private before the broker publishes, so a
    thread that keeps writing during and after ``publish()`` writes into the
    writer's own pages: the reader, woken by the publish, sees one value."""
    reader = Worker("publish_reader", broker.url, "raced")
    try:
        reader.expect("ready")
        with broker.client() as c:
            for rnd in range(12):
                out = c.empty("raced", (nbytes // 8,), "int64")
                a = np.from_dlpack(out)
                reader.send(str(out.version - 1))
                stop = threading.Event()
                writer = threading.Thread(target=_write_until, args=(a, stop))
                writer.start()
                try:
                    out.publish()
                    got = reader.expect("got").split()
                finally:
                    stop.set()
                    writer.join()
                assert got == ["got", str(out.version), "1"], (
                    f"round {rnd}: element 0 changed after the reader's get returned ({got})"
                )
                del a, out, writer
            c.delete("raced")
            wait_for(lambda: c.stat().leases == 0, 10, what="the reader's leases to end")
    finally:
        reader.close()
    broker.check_clean()


def test_a_reader_that_locks_its_memory_never_reads_stray_or_dead_bytes(broker: BrokerProc) -> None:
    """Under ``mlockall`` the kernel copies every page of a private mapping
    and refuses to drop locked pages: the reader's stray write must not
    reach its later gets, and a new tensor placed in a dead one's bytes must
    read as published, not as the dead tensor's (stray) bytes."""
    reader = Worker("mlocked_reader", broker.url)
    try:
        reader.expect("ready")
        with broker.client() as c:
            c.put("m", np.full(2048, 5, np.int64))
            assert reader.ask("read m", "read") == "read 5"  # maps the segment before locking
            answer = reader.ask("lock all", "")
            if answer.startswith("cannot"):
                code = errno.errorcode.get(int(answer.split()[1]))
                pytest.skip(f"mlockall refused here ({code}): run as root, or raise ulimit -l")
            assert answer == "locked"
            reader.ask("write m", "wrote")
            assert reader.ask("read m", "read") == "read 5", "a stray write reached a later get"
            for rnd in range(6):
                c.delete("m" if rnd == 0 else f"n{rnd - 1}")
                wait_for(
                    lambda: c.stat().tensors == 0 and c.stat().leases == 0,
                    10,
                    what="the deleted tensor's memory to be freed",
                )
                c.put(f"n{rnd}", np.full(2048, 6 + rnd, np.int64))  # into the freed bytes
                got = reader.ask(f"read n{rnd}", "read")
                assert got == f"read {6 + rnd}", f"round {rnd}: a new tensor read {got}"
                reader.ask(f"write n{rnd}", "wrote")
                assert reader.ask(f"read n{rnd}", "read") == f"read {6 + rnd}"
            c.delete("n5")
    finally:
        reader.close()
    broker.check_clean()
