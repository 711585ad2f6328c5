"""A batch's geometry: which of its tensors share a pack, where each lies in
its block, and the checks of its columns (``same``, the bytes it carries).

A ``put_many`` of many small tensors would cost the broker a pool block per
tensor, allocated and freed one by one.  Its small host tensors share
*packs* instead: one block each, the tensors back to back at the pool's
alignment, so that a client sees each at the offset it would have had in a
block of its own.  A pack is allocated once and freed once, when its last
version goes (``Block.refs`` counts the versions in it, as it counts
``link`` and ``same`` sharers): a version superseded or deleted keeps its
bytes, at most the rest of its pack, until then.  A tensor larger than
``PACK_MEMBER_MAX``, or on a GPU, has a block of its own.

All of this depends on the request alone, so it is worked out once per
request as a ``Plan``; a producer that sends the same head step after step
gets the same request object back from the broker's parser
(``_http._handler.parse_framed``), whose plan ``Plans`` keeps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._errors import InvalidRequest
from ..._proto import INLINE_BATCH_MAX
from ._records import CPU, Checked, check_item

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..._wire import ManyAlloc
    from ...shm._pool import Block

# A tensor this small goes in its batch's pack.  A block, a version and a
# lease of its own cost the broker and the client some 15-20 us together,
# about 5% of copying 4 MiB at this machine's 10 GB/s a thread; above that a
# tensor's own block costs less than what a pack could keep pinned for it.
PACK_MEMBER_MAX = 4 << 20
PACK_MOST = 32 << 20  # the most bytes one pack holds: what a superseded row can keep pinned
Where = tuple[int, int]  # (a batch's block, where in it)
# A pack's layouts as the wire names them: each (shape, dtype, bytes) once, and per row its index.
Layouts = tuple[list[tuple[tuple[int, ...], str, int]], list[int]]
PLANS_KEPT = 16  # the plans Plans keeps (of the requests the broker parsed once: parse_framed)
# The key of each pack's rows a plan makes (``Plan.rows``): never given twice in
# a broker's run, so a key names one list of names, offsets and layouts for
# good (a get_many's answer of a whole pack may name its columns by it).
_ROW_KEYS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a batch's request alone decides, checked: each tensor's (shape,
    dtype, item size, bytes), the bytes of them all (``total``) and of those
    that are not an earlier one's (``need``: what a put_many carries), the
    blocks the batch needs (``sizes``), where each tensor goes (``where``,
    see ``layout``), the bytes its tensors take in each block (``used``),
    per tensor its block, where in it and whether an earlier tensor of the
    batch is in that block (``spots``: an earlier one's bytes resolved),
    the blocks that are packs, two of its own tensors or more
    (``packs``), and, for a put_many, what each pack's rows are (``rows``:
    per pack, its block and its tensors' positions, names, items, offsets,
    layouts and key, shared by every ``Pack`` of this request), the tensors that
    are not rows of a pack (``lone``: they get ``Version``s), and where the
    bytes a put_many carries go (``runs``: (block, where in it, bytes), in
    the body's order, back-to-back tensors of a block as one)."""

    items: list[Checked]
    total: int
    need: int
    sizes: list[int]
    where: list[Where]
    used: list[int]
    spots: list[tuple[int, int, bool]]
    packs: list[int]
    rows: list[tuple[int, list[int], list[str], list[Checked], list[int], Layouts, int]]
    lone: list[int]
    runs: list[tuple[int, int, int]]


class Plans:
    """``plan`` of the last few requests, kept by request object.  A request
    the broker parsed once is the same object each time it comes (a state
    dict's put_many, step after step: ``_http._handler.parse_framed``), and
    is planned once.  Requests that name devices are planned each time: their
    check asks the GPUs (``devices``)."""

    def __init__(self, align: int, most: int) -> None:
        self.align, self.most = align, most
        self._kept: dict[int, tuple[ManyAlloc, Plan]] = {}

    def plan(self, req: ManyAlloc, devices: Callable[[], None]) -> Plan:
        kept = self._kept.get(id(req))
        if kept is not None and kept[0] is req:
            return kept[1]
        made = plan(req, devices, self.align, self.most)
        if req.devices is None:
            if len(self._kept) >= PLANS_KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[id(req)] = (req, made)
        return made


def plan(req: ManyAlloc, devices: Callable[[], None], align: int, most: int) -> Plan:
    """The ``Plan`` of ``req``, or InvalidRequest; ``devices`` checks
    ``req.devices`` when it names them (InvalidRequest, OutOfMemory for a
    GPU the broker lacks)."""
    names, shapes, dtypes, same = req.names, req.shapes, req.dtypes, req.same
    if not len(names) == len(shapes) == len(dtypes):
        raise InvalidRequest(
            f"a batch needs one shape and one dtype per name: {len(names)} "
            f"names, {len(shapes)} shapes, {len(dtypes)} dtypes"
        )
    if len(set(names)) != len(names):
        raise InvalidRequest("a batch allocates each name once")
    if req.devices is not None:
        devices()
    seen: dict[tuple[str, tuple[int, ...]], Checked] = {}
    items = []
    # A state dict repeats a few (dtype, shape) pairs: each is checked once.
    for shape, d in zip(shapes, dtypes, strict=True):
        key = (d, tuple(shape))
        item = seen.get(key)
        if item is None:
            item = seen[key] = check_item(d, shape)
        items.append(item)
    if same is not None:
        check_same(names, items, same)
    total = sum(item[3] for item in items)
    need = sum(item[3] for i, item in enumerate(items) if same is None or same[i] < 0)
    sizes, where = layout(items, same, req.devices, align, most)
    used = [0] * len(sizes)
    own = [0] * len(sizes)  # tensors whose bytes are their own, per block
    taken = [False] * len(sizes)  # a tensor before this one is in the block
    spots: list[tuple[int, int, bool]] = []
    for i, ((k, at), item) in enumerate(zip(where, items, strict=True)):
        if k < 0:  # an earlier tensor's bytes (same), in its block
            assert same is not None
            k, at, _ = spots[same[i]]
        else:
            used[k] += item[3]
            own[k] += 1
        spots.append((k, at, taken[k]))
        taken[k] = True
    packs = [k for k, n in enumerate(own) if n > 1]
    of_pack: dict[int, list[int]] = {k: [] for k in packs}
    lone = []
    for i, (k, _) in enumerate(where):
        if k in of_pack:  # its own bytes in a pack (a tie's where is -1)
            of_pack[k].append(i)
        else:
            lone.append(i)
    rows = [
        (
            k,
            at,
            [names[i] for i in at],
            [items[i] for i in at],
            [where[i][1] for i in at],
            layouts([items[i] for i in at]),
            next(_ROW_KEYS),
        )
        for k, at in of_pack.items()
    ]
    runs: list[list[int]] = []
    for i, (k, at) in enumerate(where):
        n = items[i][3]
        if k < 0 or not n:  # a tie carries nothing
            continue
        if runs and runs[-1][0] == k and runs[-1][1] + runs[-1][2] == at:
            runs[-1][2] += n
        else:
            runs.append([k, at, n])
    return Plan(
        items,
        total,
        need,
        sizes,
        where,
        used,
        spots,
        packs,
        rows,
        lone,
        [(k, at, n) for k, at, n in runs],
    )


def layouts(items: list[Checked]) -> Layouts:
    """Each (shape, dtype, bytes) of ``items`` once, and per item its index."""
    index: dict[tuple[tuple[int, ...], str, int], int] = {}
    of = [index.setdefault((shape, dtype, n), len(index)) for shape, dtype, _, n in items]
    return list(index), of


def layout(
    items: list[Checked],
    same: list[int] | None,
    devices: list[str] | None,
    align: int,
    most: int,
) -> tuple[list[int], list[Where]]:
    """The blocks a batch needs (their sizes) and, per tensor, (its block,
    where in it); (-1, 0) for a tensor that is an earlier one's bytes
    (``same``).  Packs hold at most ``most`` bytes, each tensor at ``align``."""
    sizes: list[int] = []
    where: list[Where] = []
    pack = -1  # the pack being filled: its bytes so far are sizes[pack]
    for i, item in enumerate(items):
        n = item[3]
        if same is not None and same[i] >= 0:
            where.append((-1, 0))
        elif n > PACK_MEMBER_MAX or (devices is not None and devices[i] not in CPU):
            where.append((len(sizes), 0))
            sizes.append(n)
        else:
            step = max(-(-n // align) * align, align)
            if pack < 0 or sizes[pack] + step > most:
                pack = len(sizes)
                sizes.append(0)
            where.append((pack, sizes[pack]))
            sizes[pack] += step
    return sizes, where


def packed(
    blocks: list[Block], plan: Plan, only: list[int] | None = None
) -> list[tuple[Block, int, bool]]:
    """Per tensor (of ``only``, if given), its block, where in it and
    whether the block is an earlier tensor's too (``Plan.spots``).  A
    pack's ``nbytes`` becomes what its tensors need, so that the broker's
    bytes in use count them as they would count a block each."""
    for b, n in zip(blocks, plan.used, strict=True):
        b.nbytes = n
    spots = plan.spots if only is None else [plan.spots[i] for i in only]
    return [(blocks[k], at, shared) for k, at, shared in spots]


def check_same(names: list[str], items: list[Checked], same: list[int]) -> None:
    """A batch's ``same`` column: each tensor is -1 or an earlier tensor that
    is no one else's copy, of its own dtype and shape."""
    if len(same) != len(names):
        raise InvalidRequest(
            f"a batch's same column needs one entry per name: {len(names)} "
            f"names, {len(same)} entries"
        )
    for i, j in enumerate(same):
        if j < 0:
            continue
        if j >= i or same[j] >= 0:
            raise InvalidRequest(
                f"same[{i}] is {j}: a tensor can only be the bytes of an earlier "
                f"tensor of the batch that is not itself another's (-1: its own)"
            )
        if items[i][:3] != items[j][:3]:
            raise InvalidRequest(
                f"{names[i]!r} cannot share the bytes of {names[j]!r}: their "
                f"dtypes or shapes differ"
            )


def check_carried(need: int, carried: int) -> None:
    """The bytes a batch's request carries are its tensors' (``need``: those
    of its own, ``same``), and no more than ``INLINE_BATCH_MAX``."""
    if carried != need:
        raise InvalidRequest(
            f"the body carries {carried} bytes after its head, but the batch's "
            f"tensors need {need} (each one's C-ordered bytes, in order; none "
            f"for a tensor that is an earlier one's bytes)"
        )
    if need > INLINE_BATCH_MAX:
        raise InvalidRequest(
            f"a batch carries at most {INLINE_BATCH_MAX} bytes in its request; "
            f"this one has {need}: put larger batches with /v1/many/alloc and "
            f"/v1/many/publish"
        )
