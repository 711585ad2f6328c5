"""Published bytes never change: not through a writer thread still writing
while ``publish()`` runs, and not through a reader's stray writes when its
memory is locked (``mlockall``)."""

from __future__ import annotations

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


@pytest.mark.parametrize("nbytes", [pytest.param(8 << 10, id="8KiB"),
                                    pytest.param(8 << 20, id="8MiB")])
def test_a_writer_thread_racing_publish_never_changes_what_a_reader_got(
        broker: BrokerProc, nbytes: int) -> None:
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
                    f"round {rnd}: element 0 changed after the reader's get returned ({got})")
                del a, out, writer
            c.delete("raced")
            wait_for(lambda: c.stat().leases == 0, 10, what="the reader's leases to end")
    finally:
        reader.close()
    broker.check_clean()
