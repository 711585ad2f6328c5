"""One rank of a gloo job that saves or loads a DCP checkpoint in a broker.

    python dcp_rank.py save|load BROKER_URL CHECKPOINT RANK WORLD PORT [SEED] [FLAGS]

The state: a model's state dict (replicated: bf16 and float32), a DTensor
sharded over the ranks (rows), and Python values (step, a list).  ``save``
fills it from SEED, saves it, prints ``digest HEX`` (of the whole state,
every rank alike) and ``saved``, then, with ``--hold``, waits to be killed.
``--stuck`` (with save): rank 1 also saves an object whose pickling never
returns, after printing ``stuck``: its save never finishes.
``--overwrite``: DepotWriter(..., overwrite=True).
``load`` starts from other values, loads, and prints ``digest HEX`` and,
``--zero-copy``, ``adopted N``: how many plain tensors are the broker's bytes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tensordepot.checkpoint import DepotReader, DepotWriter, ZeroCopyLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

mode, url, ckpt, rank, world, port = sys.argv[1:7]
seed = int(sys.argv[7]) if len(sys.argv) > 7 and not sys.argv[7].startswith("--") else 0
flags = set(a for a in sys.argv[7:] if a.startswith("--"))
rank_i, world_i = int(rank), int(world)


class Stuck:
    """Its pickling (DCP's torch.save of a non-tensor value) never returns."""

    def __reduce__(self) -> Any:
        print("stuck", flush=True)
        time.sleep(3600)
        raise AssertionError("unreachable")


def state(fill: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(fill)
    model = {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(16, 16, generator=g),
        "proj.bias": torch.randn(16, generator=g),
        "steps": torch.arange(fill, fill + 5, dtype=torch.int64),
    }
    full = torch.randn(8, 6, generator=g)  # every rank makes the same, then keeps its rows
    return {
        "model": model,
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "extra": {"step": fill, "note": ["a", fill]},
    }


def in_shared_memory(ptr: int) -> bool:
    """Whether ``ptr`` lies in a mapping of a file of /dev/shm (a broker segment)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) > 5 and fields[5].startswith("/dev/shm/")
    return False


def digest(sd: dict[str, Any]) -> str:
    """Of the whole state, as every rank sees it (a DTensor's full tensor)."""
    h = hashlib.sha256()
    model = sd["model"]
    for k in sorted(model):
        t = model[k].contiguous()
        h.update(f"{k}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    full = sd["sharded"].full_tensor()  # collective
    h.update(full.numpy().tobytes())
    h.update(repr(sd["extra"]).encode())
    return h.hexdigest()


dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=world_i
)
mesh = init_device_mesh("cpu", (world_i,))
if mode == "save":
    sd = state(seed)
    print("digest", digest(sd), flush=True)
    if "--stuck" in flags and rank_i == 1:
        sd["stuck"] = Stuck()
    dcp.save(sd, storage_writer=DepotWriter(ckpt, url=url, overwrite="--overwrite" in flags))
    print("saved", flush=True)
    if "--hold" in flags:
        time.sleep(3600)
else:
    sd = state(seed + 1000)
    before = digest(sd)
    planner = ZeroCopyLoadPlanner() if "--zero-copy" in flags else None
    dcp.load(sd, storage_reader=DepotReader(ckpt, url=url), planner=planner)
    after = digest(sd)
    assert after != before
    assert isinstance(sd["sharded"], DTensor) and sd["sharded"].to_local().shape == (4, 6)
    print("digest", after, flush=True)
    if planner is not None:
        shard = sd["sharded"].to_local()  # the DTensor's local shard: adopted too
        print(
            "adopted",
            sum(in_shared_memory(t.data_ptr()) for t in sd["model"].values())
            + in_shared_memory(shard.data_ptr()),
            flush=True,
        )
    dist.barrier()
    del sd
dist.destroy_process_group()
# Out without the interpreter's teardown: gloo's threads, destroyed there
# unjoined, abort the process now and then ("terminate called without an
# active exception").  DepotReader and DepotWriter closed their clients.
sys.stdout.flush()
os._exit(0)
