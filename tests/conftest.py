"""Fixtures: a real ``tensordepot serve`` process per test.

Every broker started here gets its own socket and segment prefix.  On
teardown the fixture checks that the broker's accounting is clean (no
sessions, no leases, and no bytes once the remaining names are deleted),
stops it with SIGTERM, and checks that /dev/shm holds nothing of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _both import Api
from _harness import RUN_ID, RUN_VAR, TEST_PREFIX, BrokerProc, shm_entries
from _workerio import Worker

REQUIRE_CUDA = "TENSORDEPOT_REQUIRE_CUDA"  # =1 on a GPU machine: a missing GPU fails the run


def _cuda_missing() -> str | None:
    """Why ``@pytest.mark.cuda`` tests cannot run here, or None.  cupy (which
    the broker and the client use for CUDA) is asked first: torch is
    imported only where cupy sees a GPU."""
    from tensordepot.shm._cuda import unavailable

    reason = unavailable()
    if reason is not None:
        return reason
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.cuda`` tests run only where a CUDA GPU and cupy are present."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    reason = _cuda_missing() if marked else None
    if reason is None:
        return
    if os.environ.get(REQUIRE_CUDA) == "1":
        raise pytest.UsageError(f"{REQUIRE_CUDA}=1 but the CUDA tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in marked:
        item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """With ``TENSORDEPOT_REQUIRE_CUDA=1`` (the GPU machine), a CUDA test
    that skips itself (a missing module, too few GPUs) fails: there, every
    one must run."""
    report = yield
    if (
        report.skipped
        and os.environ.get(REQUIRE_CUDA) == "1"
        and item.get_closest_marker("cuda") is not None
    ):
        report.outcome = "failed"
        why = call.excinfo.value if call.excinfo is not None else "skipped"
        report.longrepr = f"{REQUIRE_CUDA}=1 but this CUDA test skipped: {why}"
    return report


@pytest.fixture
def broker_factory() -> Iterator[Callable[..., BrokerProc]]:
    """Start brokers; each is checked for clean accounting and a clean /dev/shm at the end.

    A test that killed its broker on purpose sets ``b.expect_dead = True``."""
    started: list[BrokerProc] = []

    def start(*args: str, **kw: Any) -> BrokerProc:
        b = BrokerProc(*args, **kw)
        b.expect_dead = False  # type: ignore[attr-defined]
        started.append(b)
        return b

    yield start
    try:
        for b in started:
            if b.alive:
                b.check_clean()
                rc = b.stop()
                assert rc == 0, f"broker exited with {rc} after SIGTERM:\n{b.log()}"
            elif not getattr(b, "expect_dead", False):
                raise AssertionError(f"broker died during the test:\n{b.log()}")
            left = b.segments()
            if not getattr(b, "expect_dead", False):
                assert left == [], f"SIGTERM left segments in /dev/shm: {left}"
    finally:
        for b in started:
            b.cleanup()


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerProc]) -> BrokerProc:
    return broker_factory()


@pytest.fixture
def workers(broker_factory: Callable[..., BrokerProc]) -> Iterator[Callable[..., Worker]]:
    """Start driven workers (``_workerio.Worker``): ``workers(script, *args,
    ready=PREFIX, **kw)`` waits for a line starting with ``ready`` when
    given.  Every one is killed and reaped at the end, stopped ones too,
    before the brokers are checked (this fixture is set up after theirs)."""
    started: list[Worker] = []

    def start(
        script: str, *args: str, ready: str | None = None, ready_timeout: float = 30.0, **kw: Any
    ) -> Worker:
        w = Worker(script, *args, **kw)
        started.append(w)
        if ready is not None:
            w.expect(ready, ready_timeout)
        return w

    yield start
    for w in started:
        w.close()


@pytest.fixture(params=[pytest.param("sync", id="Client"), pytest.param("async", id="AsyncClient")])
def api(request: pytest.FixtureRequest, broker: BrokerProc) -> Iterator[Api]:
    """One test's calls made through a Client, then through an AsyncClient."""
    a = Api(broker.url, request.param)
    try:
        yield a
    finally:
        a.close()


def pytest_configure(config: pytest.Config) -> None:
    """The run's segment prefix, for the workers of ``pytest -n`` to inherit
    (they start after this, with this process's environment)."""
    if not hasattr(config, "workerinput"):
        os.environ[RUN_VAR] = RUN_ID


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After the whole suite, nothing of ours may be left in /dev/shm.  Run by
    the process that reports the outcome (not by a ``pytest -n`` worker, whose
    neighbours may still be using their segments)."""
    if hasattr(session.config, "workerinput"):
        return
    left = shm_entries(TEST_PREFIX)
    if left:
        for entry in left:
            try:
                os.unlink(os.path.join("/dev/shm", entry))
            except FileNotFoundError:
                pass
        print(f"\nERROR: the test suite left {len(left)} segment(s) in /dev/shm: {left[:5]}")
        session.exitstatus = 1
