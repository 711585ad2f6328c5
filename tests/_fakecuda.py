"""A stand-in for cupy's CUDA runtime and driver, as far as tensordepot's
device switching, events and streams go, for tests without a GPU.  It keeps,
per thread, the current context (a thread that never chose a device has
none), and creates a device's primary context when a thread first makes
that device current, as CUDA 12 does; it records which thread recorded
which event on which stream.  ``module`` goes where ``shm._cuda._cupy()``
returns cupy."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace
from typing import Any


class FakeCuda:
    """cupy.cuda's runtime and driver, as far as device switching goes."""

    def __init__(self) -> None:
        self.contexts: set[int] = set()  # devices with a primary context
        self.switches = 0
        # (event, stream, calling thread's name) of each record and stream wait
        self.recorded: list[tuple[int, int, str]] = []
        self.waited: list[tuple[int, int, str]] = []
        self._handles = itertools.count(0x1000)
        self.completed: set[int] = set()  # events whose work is done (others: not ready)
        self.closed: list[int] = []  # addresses passed to cudaIpcCloseMemHandle
        self._current = threading.local()
        fake = self

        class Device:  # cupy.cuda.Device's switch and restore, for the code before on_device
            def __init__(self, ordinal: int) -> None:
                self.ordinal = ordinal

            def __enter__(self) -> None:
                self.before = fake.runtime.getDevice()
                fake.runtime.setDevice(self.ordinal)

            def __exit__(self, *exc: Any) -> None:
                fake.runtime.setDevice(self.before)

        class Stream:  # cupy.cuda.Stream: a handle
            def __init__(self, non_blocking: bool = False) -> None:
                self.ptr = fake.handle()

        self.runtime = SimpleNamespace(
            getDevice=self.get_device,
            setDevice=self.set_device,
            eventCreateWithFlags=lambda flags: self.handle(),
            eventRecord=self.event_record,
            streamWaitEvent=self.stream_wait,
            eventDestroy=lambda event: None,
            eventQuery=self.event_query,
            ipcCloseMemHandle=self.closed.append,
        )
        self.driver = SimpleNamespace(ctxGetCurrent=self.ctx_get, ctxSetCurrent=self.ctx_set)
        self.module = SimpleNamespace(
            cuda=SimpleNamespace(
                runtime=self.runtime, driver=self.driver, Device=Device, Stream=Stream
            )
        )

    def ctx_get(self) -> int:
        return getattr(self._current, "ctx", 0)  # a context handle: its device + 1

    def ctx_set(self, ctx: int) -> None:
        assert ctx == 0 or ctx - 1 in self.contexts, "only a context that exists can be current"
        self._current.ctx = ctx

    def get_device(self) -> int:
        ctx = self.ctx_get()
        return ctx - 1 if ctx else 0  # a thread without a context: device 0

    def set_device(self, ordinal: int) -> None:
        self.switches += 1
        self.contexts.add(ordinal)  # CUDA 12: cudaSetDevice creates the primary context
        self._current.ctx = ordinal + 1

    def handle(self) -> int:
        return next(self._handles)

    def event_record(self, event: int, stream: int) -> None:
        self.recorded.append((event, stream, threading.current_thread().name))

    def stream_wait(self, stream: int, event: int, flags: int) -> None:
        self.waited.append((stream, event, threading.current_thread().name))

    def event_query(self, event: int) -> int:
        return 0 if event in self.completed else 600  # cudaSuccess, cudaErrorNotReady
