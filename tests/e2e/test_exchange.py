"""Issue: core exchange.  A real broker, a producer process and a consumer process."""

from __future__ import annotations

import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, file_position, run_worker, shm_entries, wait_for
from tensordepot import BrokerUnavailable, Client, TensorNotFound


def test_producer_consumer_processes(broker: BrokerProc) -> None:
    res = run_worker("producer", broker.url)
    assert "produced" in res.stdout
    # The producer has exited; its tensors outlive it.
    res = run_worker("consumer", broker.url)
    assert "consumed 8" in res.stdout, res.stdout
    with broker.client() as c:
        names = {i.name for i in c.list()}
    assert names == {"f32", "f64", "i64", "bool", "f16", "u8_strided", "big_f32", "filled"}


def test_get_unknown_raises(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("present", np.zeros(3))
        with pytest.raises(TensorNotFound, match=r"'missing' not found.*known: present"):
            c.get("missing")
        with pytest.raises(KeyError):  # TensorNotFound is also a KeyError
            c.get("missing")


def test_get_waits_for_publish(broker: BrokerProc) -> None:
    def late_put() -> None:
        time.sleep(0.5)  # the thing under test is a wait; this is the producer being late
        with broker.client() as p:
            p.put("late", np.arange(5.0))

    th = threading.Thread(target=late_put)
    with broker.client() as c:
        t0 = time.monotonic()
        th.start()
        t = c.get("late", timeout=5)
        waited = time.monotonic() - t0
        assert np.array_equal(np.from_dlpack(t), np.arange(5.0))
        del t
    th.join()
    assert 0.4 <= waited < 2.0, f"get returned after {waited:.2f} s"


def test_get_timeout_expires(broker: BrokerProc) -> None:
    with broker.client() as c:
        t0 = time.monotonic()
        with pytest.raises(TensorNotFound, match=r"not published within 0\.3"):
            c.get("never", timeout=0.3)
        assert time.monotonic() - t0 < 2


def test_old_version_keeps_its_bytes(broker: BrokerProc) -> None:
    with broker.client() as prod, broker.client() as cons:
        prod.put("w", np.full(100_000, 1.0))  # 800 KB: not inline
        v1 = cons.get("w")
        a1 = np.from_dlpack(v1)
        prod.put("w", np.full(100_000, 2.0))
        v2 = cons.get("w")
        assert (v1.version, v2.version) == (1, 2)
        assert np.all(a1 == 1.0) and np.all(np.from_dlpack(v2) == 2.0)
        # Churn the pool so a freed version-1 range would be reused and overwritten.
        for i in range(5):
            prod.put(f"churn{i}", np.full(100_000, 9.0))
        assert np.all(a1 == 1.0)
        del a1, v1, v2


def test_empty_publish_roundtrip_torch(broker: BrokerProc) -> None:
    torch = pytest.importorskip("torch")
    with broker.client() as c:
        out = c.empty("y", (128, 64), "bfloat16")
        torch.from_dlpack(out).fill_(1.5)
        assert c.list()[0].state == "writing"
        with pytest.raises(TensorNotFound):
            c.get("y")
        out.publish()
        got = torch.from_dlpack(c.get("y"))
        assert got.dtype == torch.bfloat16 and bool((got == 1.5).all())
        del got, out


def _signals(pid: int, sig: int) -> set[str]:
    """Which of process ``pid``'s signal masks (``/proc/<pid>/status``:
    SigPnd, ShdPnd, SigIgn, SigCgt, ...) hold ``sig``."""
    with open(f"/proc/{pid}/status") as f:
        names = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")  # SigQ is a count
        masks = dict(line.split(":", 1) for line in f if line.startswith(names))
    return {k for k, v in masks.items() if int(v, 16) & (1 << (sig - 1))}


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits to be delivered to process ``pid``."""
    return bool(_signals(pid, sig) & {"SigPnd", "ShdPnd"})


@pytest.mark.parametrize(
    "sigs",
    [
        pytest.param([signal.SIGTERM], id="SIGTERM"),  # kill, a supervisor
        pytest.param([signal.SIGINT], id="SIGINT"),  # Ctrl-C in its terminal
        pytest.param([signal.SIGHUP], id="SIGHUP"),  # its terminal closed
        # Ctrl-C twice: uvicorn's forced exit, which skips its lifespan shutdown
        pytest.param([signal.SIGINT, signal.SIGINT], id="SIGINT-twice"),
    ],
)
def test_a_stop_signal_unlinks_everything(broker_factory, sigs) -> None:  # type: ignore[no-untyped-def]
    b = broker_factory()
    with b.client() as c:
        c.put("a", np.zeros(10))
        c.put("b", np.zeros(1 << 20))
        t = c.get("b")
        assert b.segments(), "the broker should hold segments"
        del t
    assert b.proc is not None
    pid = b.proc.pid
    for sig in sigs[:-1]:  # each delivered before the next is sent, so that none merge
        os.kill(pid, sig)
        wait_for(lambda s=sig: not _pending(pid, s), 5, what="the signal to be delivered")
    assert b.stop(sigs[-1]) == 0, b.log()
    assert b.segments() == [], b.segments()
    assert not os.path.exists(b.sock), "the socket file should be removed"
    assert "Traceback" not in b.log(), b.log()
    b.expect_dead = True


def _disposition(pid: int, sig: int) -> str:
    """How process ``pid`` takes ``sig``: "ignored", "caught" or "default"."""
    held = _signals(pid, sig)
    return "ignored" if "SigIgn" in held else "caught" if "SigCgt" in held else "default"


def test_a_broker_started_with_nohup_outlives_its_terminal(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """nohup (SIGHUP ignored when it starts) keeps its meaning: the broker
    leaves SIGHUP ignored and keeps serving after one, where a broker started
    without it catches SIGHUP to shut down cleanly."""
    if shutil.which("nohup") is None:
        pytest.skip("no nohup")
    plain = broker_factory()
    assert plain.proc is not None
    assert _disposition(plain.proc.pid, signal.SIGHUP) == "caught"
    b = broker_factory(launcher=["nohup"])
    assert b.proc is not None
    assert _disposition(b.proc.pid, signal.SIGHUP) == "ignored"
    b.proc.send_signal(signal.SIGHUP)  # an ignored signal is dropped by the kernel
    with b.client() as c:
        c.put("w", np.arange(4, dtype=np.float32))
        assert np.from_dlpack(c.get("w")).tolist() == [0.0, 1.0, 2.0, 3.0]
        c.delete("w")
    assert b.proc.poll() is None, b.log()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_broker_started_in_a_terminal_cleans_up_when_the_terminal_closes() -> None:
    """The README's set-up command (`tensordepot serve &` in an interactive
    shell), then its terminal closes: the shell hangs up its jobs (SIGHUP),
    and the broker unlinks every segment and its socket, as on SIGTERM."""
    if shutil.which("setsid") is None or shutil.which("bash") is None:
        pytest.skip("no setsid (util-linux) or bash to run a shell in a terminal of its own")
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    sock = os.path.join(tempfile.mkdtemp(prefix="td-", dir="/tmp"), "broker.sock")
    master, slave = os.openpty()
    shell = subprocess.Popen(
        ["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    pid = None
    try:
        serve = (
            f"{sys.executable} -m tensordepot serve --listen unix://{sock} --shm-prefix {prefix}"
        )
        os.write(master, f"{serve} --max-memory 64MiB --prealloc 0 &\n".encode())
        deadline = time.monotonic() + 30
        while pid is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
                found = re.search(rb"tensordepot ready: pid (\d+)", seen)
                pid = int(found.group(1)) if found else None
        assert pid is not None, f"the broker did not start in the terminal: {seen[-2000:]!r}"
        with Client(f"unix://{sock}") as c:
            c.put("w", np.ones(1 << 20, np.float32))
        assert shm_entries(prefix), "the broker should hold segments"
        os.close(master)  # the terminal closes
        master = -1
        wait_for(lambda: not _alive(pid), 15, what="the broker to exit once its terminal closed")
        assert shm_entries(prefix) == [], f"the broker left {shm_entries(prefix)} in /dev/shm"
        assert not os.path.exists(sock), "the socket file should be removed"
    finally:
        if master >= 0:
            os.close(master)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait(10)
        for name in shm_entries(prefix):
            os.unlink(os.path.join("/dev/shm", name))


def test_close_never_raises_without_broker(broker_factory) -> None:  # type: ignore[no-untyped-def]
    b = broker_factory()
    c = b.client()
    c.put("x", np.ones(4))
    b.kill()
    b.expect_dead = True
    with pytest.raises(BrokerUnavailable, match="is `tensordepot serve` running"):
        c.put("y", np.ones(4))
    c.close()
    c.close()


def test_client_without_broker_is_clear(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BrokerUnavailable, match="cannot reach the tensordepot broker"):
        Client(f"unix://{tmp_path}/nope.sock")


def test_socket_mode_is_0600(broker: BrokerProc) -> None:
    assert os.stat(broker.sock).st_mode & 0o777 == 0o600
    with broker.client() as c:
        c.put("s", np.zeros(1 << 18))
    for seg in broker.segments():
        mode = os.stat(f"/dev/shm/{seg}").st_mode & 0o777
        assert mode == 0o600, (seg, oct(mode))


def test_second_broker_on_live_socket_refuses(broker: BrokerProc) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "tensordepot", "serve", "--listen", broker.url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode != 0
    assert "a live broker already listens" in res.stderr


def test_stale_socket_is_replaced(broker_factory) -> None:  # type: ignore[no-untyped-def]
    b = broker_factory()
    with b.client() as c:
        c.put("x", np.zeros(1 << 18))
    b.kill()
    assert os.path.exists(b.sock) and b.segments()
    stale = [s for s in b.segments() if not s.endswith("lock")]
    assert stale
    b2 = broker_factory(sock_dir=b.dir, prefix=b.prefix)
    b.expect_dead = True
    wait_for(lambda: not set(stale) & set(b2.segments()), 5, what="stale segments to go")
    with b2.client() as c, pytest.raises(TensorNotFound):
        c.get("x")


def test_put_of_a_got_tensor_shares_its_bytes(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("src", np.arange(1 << 18, dtype=np.float32))  # 1 MiB
        before = c.stat().bytes_in_use
        t = c.get("src")
        assert c.put("alias", t) == 1
        assert c.stat().bytes_in_use == before, "re-putting broker memory must not copy it"
        alias = np.from_dlpack(c.get("alias"))
        # Both map the same bytes of the same segment.
        where = file_position(alias.__array_interface__["data"][0])
        assert where == file_position(np.from_dlpack(t).__array_interface__["data"][0])
        assert where[0].startswith("/dev/shm/"), where
        c.delete("src")
        del t
        assert np.array_equal(alias, np.arange(1 << 18, dtype=np.float32))
        assert c.stat().bytes_in_use == before  # still held by "alias"
        del alias
        c.delete("alias")
        wait_for(
            lambda: c.stat().bytes_in_use == 0 or None,
            5,
            what=f"shared block to be freed ({c.stat()}, {c.list()})",
        )


def test_publish_after_delete_is_broken_and_frees(broker: BrokerProc) -> None:
    from tensordepot import TensorBroken

    with broker.client() as c:
        out = c.empty("z", (1 << 16,), "float32")
        np.from_dlpack(out).fill(3.0)
        c.delete("z")
        with pytest.raises(TensorBroken, match="allocation is gone") as info:
            out.publish()
        assert isinstance(info.value.__cause__, TensorNotFound)
        with pytest.raises(TensorNotFound):
            c.get("z")
        # The writer's own view keeps the memory (nobody else gets it) until it dies.
        assert c.stat().bytes_in_use == 1 << 18
        del out, info  # the exception's traceback holds the tensor too
        wait_for(lambda: c.stat().bytes_in_use == 0, 5, what="the orphaned allocation to be freed")


def test_put_of_another_clients_bfloat16_tensor_keeps_its_dtype(broker: BrokerProc) -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(64, 8).to(torch.bfloat16)
    with broker.client() as a, broker.client() as b:
        a.put("bf", src)
        t = a.get("bf")
        assert b.put("bf_copy", t) == 1  # b holds no lease on it: a real copy
        got = torch.from_dlpack(b.get("bf_copy"))
        assert got.dtype == torch.bfloat16 and torch.equal(got, src)
        del t, got
