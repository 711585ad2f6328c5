"""In-memory checkpoints through torch.distributed.checkpoint, against a real
broker: 2-rank gloo jobs (tests/workers/dcp_rank.py) save a model's state,
a DTensor sharded over the ranks and Python values with ``DepotWriter``, are
SIGKILLed, and 2 new ranks load it bit-exact with ``DepotReader``; a save
killed midway leaves the previous checkpoint readable; checkpoints are
listed and deleted by id from the command line, and pushed to another
host's broker."""

from __future__ import annotations

import os
import pickle
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _harness import WORKERS, BrokerProc, free_port, ok, wait_for
from _hosts import flight_url
from tensordepot import InvalidRequest, TensorNotFound
from tensordepot.checkpoint import DepotReader, DepotWriter, ZeroCopyLoadPlanner, push

pytestmark = pytest.mark.filterwarnings(
    # DCP says so whenever it runs in one process, without a process group.
    "ignore:torch.distributed is disabled:UserWarning"
)


class Job:
    """Ranks of one gloo job, each a process of its own, read line by line."""

    def __init__(
        self, mode: str, broker: BrokerProc, ckpt: str, *args: str, world: int = 2
    ) -> None:
        port = str(free_port())
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKERS / "dcp_rank.py"),
                    mode,
                    broker.url,
                    ckpt,
                    str(r),
                    str(world),
                    port,
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]

    def line(self, rank: int, starts: str, timeout: float = 120) -> str:
        """The rank's next line that starts with ``starts`` (its rest)."""
        out: IO[str] | None = self.procs[rank].stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([out], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"rank {rank} said no {starts!r} within {timeout} s")
            text = out.readline()
            if not text:
                err = self.procs[rank].stderr
                raise AssertionError(
                    f"rank {rank} ended ({self.procs[rank].wait()}) before "
                    f"{starts!r}:\n{err.read() if err else ''}"
                )
            if text.startswith(starts):
                return text[len(starts) :].strip()

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(30)
            assert p.returncode == -signal.SIGKILL

    def join(self) -> None:
        for r, p in enumerate(self.procs):
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"rank {r} failed ({p.returncode}):\n{err}"

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for j in started:
        j.close()


def _saved(broker: BrokerProc, jobs: list[Job], ckpt: str, *args: str) -> str:
    """Save with 2 ranks, then SIGKILL both (they wait to be killed): the state's digest."""
    job = Job("save", broker, ckpt, *args, "--hold")
    jobs.append(job)
    digests = {job.line(r, "digest ") for r in (0, 1)}
    assert len(digests) == 1, "every rank sees the same state"
    for r in (0, 1):
        job.line(r, "saved")
    job.kill()
    return digests.pop()


def _loaded(broker: BrokerProc, jobs: list[Job], ckpt: str, *args: str) -> list[str]:
    job = Job("load", broker, ckpt, *args)
    jobs.append(job)
    got = [job.line(r, "digest ") for r in (0, 1)]
    if "--zero-copy" in args:
        got += [job.line(r, "adopted ") for r in (0, 1)]
    job.join()
    return got


def test_a_checkpoint_outlives_both_ranks_and_loads_bit_exact_in_new_ones(
    broker: BrokerProc, jobs: list[Job]
) -> None:
    want = _saved(broker, jobs, "run1/step-100", "7")
    with broker.client() as c:
        names = [i.name for i in c.list(prefix="run1/step-100/")]
        assert "run1/step-100/.metadata" in names
        # The model is replicated: written once, by one rank; the DTensor by both.
        assert len(names) == 1 + 4 + 2 + 2, names
    assert _loaded(broker, jobs, "run1/step-100") == [want, want]
    # Zero copy: every model tensor of every rank, and its DTensor shard, is the broker's bytes.
    assert _loaded(broker, jobs, "run1/step-100", "--zero-copy") == [want, want, "5", "5"]
    listed = ok("ls", "--prefix", "run1/", "--url", broker.url)
    assert "run1/step-100/.metadata" in listed and len(listed.splitlines()) == 1 + len(names)
    ok("rm", "--prefix", "run1/step-100/", "--url", broker.url)
    with broker.client() as c:
        assert c.list(prefix="run1/") == []
        wait_for(
            lambda: c.stat().sessions == 1 and c.stat().leases == 0,
            30,
            what="the ranks' sessions and leases to end",
        )


def test_a_save_killed_midway_leaves_the_previous_checkpoint_readable(
    broker: BrokerProc, jobs: list[Job]
) -> None:
    first = _saved(broker, jobs, "run2/latest", "1")
    with broker.client() as c:
        before = {i.name for i in c.list(prefix="run2/")}
    # A second save of the same id: rank 0 puts its tensors, rank 1 never gets there.
    job = Job("save", broker, "run2/latest", "2", "--overwrite", "--stuck")
    jobs.append(job)
    job.line(1, "stuck")
    with broker.client() as c:
        wait_for(
            lambda: len(c.list(prefix="run2/")) > len(before),
            60,
            what="rank 0 of the second save to put its tensors",
        )
    job.kill()
    assert _loaded(broker, jobs, "run2/latest", "1") == [first, first]
    # The next save that finishes drops what the killed one left.
    second = _saved(broker, jobs, "run2/latest", "3", "--overwrite")
    assert second != first
    with broker.client() as c:
        names = {i.name for i in c.list(prefix="run2/")}
        assert len(names) == len(before) and not names & (before - {"run2/latest/.metadata"})
    assert _loaded(broker, jobs, "run2/latest", "3") == [second, second]
    with broker.client() as c:
        c.delete(prefix="run2/")


def test_one_process_saves_and_loads_every_kind_of_value(broker: BrokerProc) -> None:
    sd = {
        "w": torch.randn(3, 5).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(20.0)[::2],
        "opt": {"lr": 0.5, "betas": (0.9, 0.99)},
    }
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    back = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()
    }
    back["opt"] = {"lr": 0.0, "betas": (0.0, 0.0)}
    with broker.client() as c:
        dcp.save(sd, storage_writer=DepotWriter("one/a", client=c))
        dcp.load(back, storage_reader=DepotReader("one/a", client=c))
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert back[k].dtype == v.dtype, k
                assert torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
            else:
                assert back[k] == v, k
        c.delete(prefix="one/")
        wait_for(lambda: c.stat().leases == 0, 10, what="the load's leases to end")


def test_an_async_save_loads_like_a_save(broker: BrokerProc) -> None:
    """``dcp.async_save`` stages the state and writes it with the same DepotWriter."""
    sd = {"w": torch.randn(100, 10), "step": 4}
    back = {"w": torch.zeros(100, 10), "step": 0}
    with broker.client() as c:
        dcp.async_save(sd, storage_writer=DepotWriter("five/a", client=c)).result(timeout=60)
        dcp.load(back, storage_reader=DepotReader("five/a", client=c))
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 4
        c.delete(prefix="five/")
        wait_for(lambda: c.stat().leases == 0, 10, what="the load's leases to end")


def test_without_collectives_each_rank_keeps_its_own_metadata(broker: BrokerProc) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    back = {"w": torch.zeros(3, 4), "step": 0}
    with broker.client() as c:
        dcp.save(sd, storage_writer=DepotWriter("four/a", client=c), use_collectives=False)
        names = [i.name for i in c.list(prefix="four/a/")]
        assert "four/a/.metadata.0" in names and "four/a/.metadata" not in names, names
        dcp.load(back, storage_reader=DepotReader("four/a", client=c))  # falls back to rank 0's
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 7
        dcp.save(
            sd,
            storage_writer=DepotWriter("four/a", client=c, overwrite=True),
            use_collectives=False,
        )
        assert len(c.list(prefix="four/a/")) == len(names), "the earlier save's tensors dropped"
        c.delete(prefix="four/")
        wait_for(lambda: c.stat().leases == 0, 10, what="the load's leases to end")


def test_what_cannot_be_meant_is_refused_with_what_to_do(broker: BrokerProc) -> None:
    sd = {"w": torch.ones(4)}
    with pytest.raises(InvalidRequest, match="has no checkpoint id"):
        DepotWriter(None).prepare_global_plan([])
    with pytest.raises(InvalidRequest, match="not a valid tensor name"):
        DepotWriter("bad id")
    with broker.client() as c:
        dcp.save(sd, storage_writer=DepotWriter("two/a", client=c))
        with pytest.raises(BaseException, match="exists already") as err:  # CheckpointException
            dcp.save(sd, storage_writer=DepotWriter("two/a", client=c))
        assert "overwrite=True" in str(err.value)
        with pytest.raises(BaseException, match="no checkpoint 'two/b'"):
            dcp.load(sd, storage_reader=DepotReader("two/b", client=c))
        with pytest.raises(TensorNotFound, match="tensordepot ls --prefix two/b/"):
            DepotReader("two/b", client=c).read_metadata()
        # Metadata that is not DCP's, or that would run code when unpickled, is refused.
        c.put("two/c/.metadata", np.frombuffer(b"not a pickle", np.uint8))
        c.put("two/d/.metadata", np.frombuffer(pickle.dumps(os.system), np.uint8))
        for cid, says in (("two/c", "not a DCP checkpoint"), ("two/d", "posix.system is not")):
            with pytest.raises(Exception, match=says):
                DepotReader(cid, client=c).read_metadata()
        c.delete(prefix="two/")
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().sessions == 1,
            10,
            what="the readers' leases to end",
        )


def _call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (dotted names
    resolved, as STACK_GLOBAL does) with one string."""

    def text(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE

    return (
        b"\x80\x04"
        + text(module)
        + text(name)
        + b"\x93"  # PROTO 4, STACK_GLOBAL
        + text(arg)
        + b"\x85R."
    )  # TUPLE1, REDUCE, STOP


@pytest.mark.parametrize(
    ("module", "name"),
    [
        pytest.param("tensordepot.checkpoint._dcp", "builtins.exec", id="through-our-module"),
        pytest.param("tensordepot.checkpoint._dcp", "pickle.loads", id="our-module-imports"),
        pytest.param("torch.distributed.checkpoint.filesystem", "os.system", id="through-dcp"),
        pytest.param(
            "torch.distributed.checkpoint.metadata",
            "Metadata.__reduce_ex__.__globals__",
            id="dotted-allowed-class",
        ),
        pytest.param("torch", "load", id="torch-function"),
        pytest.param("torch", "Size.__new__", id="dotted-torch"),
    ],
)
def test_checkpoint_metadata_never_runs_code(
    broker: BrokerProc, tmp_path: Path, module: str, name: str
) -> None:
    """A write token within a checkpoint's prefix can replace its metadata, but
    what it writes is never run: every global is matched exactly, and no
    dotted name is resolved."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    arg = {"builtins.exec": code, "os.system": f"touch {marker}"}.get(name, code)
    with broker.client() as c:
        c.put("evil/a/.metadata", np.frombuffer(_call(module, name, arg), np.uint8))
        with pytest.raises(Exception, match=f"{module}.{name} is not part of a DCP"):
            DepotReader("evil/a", client=c).read_metadata()
        assert not marker.exists(), "the metadata ran code in the loading process"
        c.delete(prefix="evil/")
        wait_for(lambda: c.stat().leases == 0, 10, what="the reader's leases to end")


def test_a_zero_copy_load_copies_what_it_cannot_adopt(broker: BrokerProc) -> None:
    sd = {"a": torch.arange(6.0), "b": torch.arange(4, dtype=torch.int32)}
    dest = {"a": torch.zeros(6), "b": torch.zeros(4, dtype=torch.float64)}  # b: another dtype
    kept = dict(dest)
    with broker.client() as c:
        dcp.save(sd, storage_writer=DepotWriter("three/a", client=c))
        dcp.load(
            dest, storage_reader=DepotReader("three/a", client=c), planner=ZeroCopyLoadPlanner()
        )
        assert torch.equal(dest["a"], sd["a"]) and torch.equal(dest["b"], sd["b"].double())
        assert dest["a"] is not kept["a"], "adopted: the broker's bytes"
        assert dest["b"] is kept["b"], "copied into, converted"
        assert c.stat().leases == 1, "the adopted tensor holds its lease"
        c.delete(prefix="three/")
        del dest, kept
        wait_for(lambda: c.stat().leases == 0, 10, what="the adopted tensor's lease to end")


def test_a_checkpoint_pushed_to_another_broker_loads_there(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """Host loss: ``push`` sends the checkpoint to another broker's Flight
    endpoint, metadata last, and a DepotReader there loads it bit-exact."""
    pytest.importorskip("pyarrow.flight")
    token = secrets.token_urlsafe(24)
    a = broker_factory()
    b = broker_factory("--flight", "grpc://127.0.0.1:0", env={"TENSORDEPOT_TOKEN": token})
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16), "step": 3}
    with a.client() as ca, b.client() as cb:
        dcp.save(sd, storage_writer=DepotWriter("run3/step-3", client=ca))
        assert push("run3/step-3", flight_url(b), client=ca, token=token) == 3
        back = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "step": 0}
        dcp.load(back, storage_reader=DepotReader("run3/step-3", client=cb))
        assert torch.equal(back["w"].view(torch.uint8), sd["w"].view(torch.uint8))
        assert back["step"] == 3
        for c in (ca, cb):
            c.delete(prefix="run3/")
