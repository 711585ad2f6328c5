"""A version on the wire, made in one place: one handle (``handle``, and
``handle_json``, its JSON), or many as columns (``columns``).

Every answer that describes a version's memory comes from here: the tensor
routes, the batch routes (``/v1/many/*``) and ``/v1/cuda/share``.  A
shared-memory handle names its segment, offset and size, with C strides
(``c_strides``, the one rule for them); a GPU handle comes from the
registry's CUDA tables (``CudaMemory.handle``), which give each lease its own
release event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from ..._wire import Handle, c_strides
from .._registry._broker import Broker
from .._registry._records import Found, Version

if TYPE_CHECKING:
    from ...shm._pool import Block


def handle(broker: Broker, v: Version, lease: int | None = None) -> Handle:
    """``v``'s handle, with ``lease`` (the reader's, if it took one)."""
    if v.block.device != "cpu":
        return broker.cuda.handle(v, lease, list(c_strides(v.shape)))
    # model_validate, though valid by construction: pydantic validates a
    # dict in Rust in half the time model_construct takes in Python.
    return Handle.model_validate(_host(broker, v, lease))


def _host(broker: Broker, v: Version, lease: int | None) -> dict[str, Any]:
    """A host version's ``Handle``, as a dict of its fields in the model's order."""
    return {
        "name": v.name,
        "version": v.number,
        "kind": "posix",
        "segment": v.block.segment,
        "offset": v.offset,
        "nbytes": v.nbytes,
        "shape": list(v.shape),
        "strides": list(c_strides(v.shape)),
        "dtype": v.dtype,
        "device": "cpu",
        "state": v.state,
        "lease": lease,
        "cuda": None,
        "slot": _slot(broker, v),
    }


def _slot(broker: Broker, v: Version) -> int | None:
    """Where the board shows ``v``'s name's newest (``shm._board``), for a
    client to get it again without asking; none on a broker with peers,
    whose gets may ask them (``Reads.try_get``)."""
    e = v.entry
    return None if e is None or e.slot < 0 or broker.peers is not None else e.slot


def handle_json(broker: Broker, v: Version, lease: int | None = None) -> bytes:
    """``handle(broker, v, lease)`` as JSON.  A host version's is encoded
    from its fields, without the model (what ``model_dump_json`` writes, in a
    fifth of the time: a put's answer is one); a published one's never
    changes but for the lease, so it is made once, around the lease."""
    if v.block.device != "cpu":
        return handle(broker, v, lease).model_dump_json().encode()
    if v.state != "ready":
        return to_json(_host(broker, v, lease))
    wire = v.wire
    if wire is None:
        text = to_json(_host(broker, v, None))
        head, lease_null, tail = text.rpartition(b'"lease":null')
        assert lease_null, text
        wire = v.wire = (head + b'"lease":', tail)
    return b"%s%s%s" % (wire[0], b"null" if lease is None else b"%d" % lease, wire[1])


def columns(
    broker: Broker, pairs: Sequence[tuple[Found, int | None]], state: str, known: int = 0
) -> bytes:
    """``HandleColumns`` for these versions or rows of packs (with their
    leases, if any), as JSON: a shared-memory tensor as entries of the
    columns, in the pack of its block and lease (each pack, segment and
    layout named once), any other kind as its whole ``handle`` under its
    position in ``others``.  ``known``: the key of the columns the client
    holds for these names (``BatchGet``'s ``known``; 0: none)."""
    whole = _whole_pack(broker, pairs, state, known)
    if whole is not None:
        return whole
    segments: dict[str, int] = {}
    packs: dict[tuple[Block, int | None], int] = {}
    layouts: dict[tuple[tuple[int, ...], str, int], int] = {}
    names: list[str] = []
    numbers: list[int] = []
    pack: list[int] = []
    at: list[int] = []
    layout: list[int] = []
    others: dict[int, Any] = {}
    last: Any = None  # the usual batch: runs of one pack, and of one layout
    k = -1
    last_layout: Any = None
    m = -1
    for i, (f, lease) in enumerate(pairs):
        if type(f) is tuple:  # a row of a pack
            p, j = f
            blk = p.block
            names.append(p.names[j])
            numbers.append(p.numbers[j])
            offset = p.ats[j]
            shape, dtype, _, nbytes = p.items[j]
        else:
            v: Version = f  # type: ignore[assignment]
            blk = v.block
            if blk.device != "cpu":
                others[i] = json.loads(handle(broker, v, lease).model_dump_json())
                names.append(v.name)
                numbers.append(v.number)
                pack.append(-1)
                at.append(0)
                layout.append(-1)
                continue
            names.append(v.name)
            numbers.append(v.number)
            offset, shape, dtype, nbytes = v.at, v.shape, v.dtype, v.nbytes
        key = (blk, lease)
        if key != last:
            last = key
            k = packs.setdefault(key, len(packs))
        pack.append(k)
        at.append(offset)
        shaped = (shape, dtype, nbytes)
        if shaped != last_layout:
            last_layout = shaped
            m = layouts.setdefault(shaped, len(layouts))
        layout.append(m)
    records = []
    for blk, lease in packs:
        j = segments.setdefault(blk.segment, len(segments))
        records.append((j, blk.offset, blk.size, lease))
    # pydantic_core's encoder: a 1,000-tensor answer in a quarter of json.dumps' time.
    return to_json(
        {
            "names": names,
            "versions": numbers,
            "state": state,
            "segments": list(segments),
            "packs": records,
            "pack": pack,
            "at": at,
            "layouts": list(layouts),
            "layout": layout,
            "others": others,
        }
    )


def _whole_pack(
    broker: Broker, pairs: Sequence[tuple[Found, int | None]], state: str, known: int
) -> bytes | None:
    """``columns`` of every row of one pack in order under one lease (a
    get_many of a batch put together, the usual case), from the pack's own
    columns, with their ``key``; None for anything else.  When the client
    holds the columns of that key (``known``), the answer leaves out what
    the key names (names, pack, at, layouts, layout): a pack's rows never
    change, and no other rows ever have its key (``_packs.plan``)."""
    if not pairs:
        return None
    first, lid = pairs[0]
    if type(first) is not tuple or lid is None:
        return None
    p = first[0]
    n = len(p.names)
    lease = broker.leases.get(lid)
    if lease is None or lease.pack is not p or len(pairs) != n or lease.rows != tuple(range(n)):
        return None  # (its rows are the pairs' own, in their order: Leases._group)
    blk = p.block
    slots = None
    if broker.peers is None:  # (a broker with peers: its gets may ask them, see _slot)
        slots = p.slots
        if slots is None:  # a row's name keeps its slot while the row is its newest
            slots = p.slots = [e.slot for e in p.entries]
    short = known == p.key  # what the key names is left out
    layouts, layout = ([], []) if short else p.layouts
    return to_json(
        {
            "names": [] if short else p.names,
            "versions": p.numbers,
            "state": state,
            "segments": [blk.segment],
            "packs": [(0, blk.offset, blk.size, lid)],
            "pack": [] if short else [0] * n,
            "at": [] if short else p.ats,
            "layouts": layouts,
            "layout": layout,
            "others": {},
            "key": p.key,
            "slots": slots,
        }
    )
