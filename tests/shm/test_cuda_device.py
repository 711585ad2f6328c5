"""Device switching (``shm._cuda.on_device``) without a GPU, against
``FakeCuda`` (tests/_fakecuda.py): it keeps, per thread, the current
context, and creates a device's primary context when a thread first makes
that device current, as CUDA 12 does.  What it checks is what the runtime would do on a
machine with several GPUs: no context appears on a GPU that nothing asked
for, and a thread gets back the context it had."""

from __future__ import annotations

import threading

import pytest
from _fakecuda import FakeCuda
from tensordepot.shm import _cuda


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(_cuda, "_cupy", lambda: fake.module)
    return fake


def test_a_thread_without_a_device_creates_no_context_on_gpu_0(cuda: FakeCuda) -> None:
    with _cuda.on_device(3):
        assert cuda.get_device() == 3
    assert cuda.contexts == {3}, "a context on a GPU nothing asked for"
    assert cuda.ctx_get() == 0, "the thread had no context, and has none again"


def test_a_thread_on_another_device_gets_it_back(cuda: FakeCuda) -> None:
    cuda.set_device(1)
    with _cuda.on_device(2):
        assert cuda.get_device() == 2
    assert cuda.get_device() == 1 and cuda.contexts == {1, 2}


def test_a_thread_already_on_the_device_switches_nothing(cuda: FakeCuda) -> None:
    cuda.set_device(2)
    before = cuda.switches
    with _cuda.on_device(2), _cuda.on_device(2):
        pass
    assert cuda.switches == before and cuda.get_device() == 2


def test_other_threads_keep_their_own_context(cuda: FakeCuda) -> None:
    """The broker's pollers and a client's background thread: each thread
    that switched gives back what it had, and GPU 0 never gets a context."""
    left: list[int] = []

    def work() -> None:
        for ordinal in (1, 2, 1):
            with _cuda.on_device(ordinal):
                pass
        left.append(cuda.ctx_get())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert left == [0, 0, 0, 0] and cuda.contexts == {1, 2}
