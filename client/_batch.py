"""put_many and get_many, as operations of steps (``_http.py``): a state
dict in one request per step, cheap per tensor.

The requests and answers are columns (``ManyAlloc``, ``ManyPublish``,
``BatchGet``; ``HandleColumns``), so a thousand tensors cost a thousand
list entries, not a thousand validated models; an answer names each pack
(and its lease) and each layout once.  Per tensor the client then does only
what it must: a slice of the cached fill mapping to copy into, or, when it
is first read, a ``SharedTensor`` sharing its pack's lease (``TensorMap``).

Reader mappings.  A ``get`` reads through a copy-on-write range lent from
the segment's kept mapping (``shm._kept``; a fresh window where it cannot be
lent), so that a stray write through a view that ignores the read-only flag
(torch, jax) stays in that view's own private pages (README, Lifetime: M2).
A ``get_many`` takes one range per segment, over the span of the batch's
tensors in it: the tensors of one batch share it, and stay apart because
their bytes do not overlap (a write within one tensor's bytes changes no
other tensor's bytes, as a copy-on-write page holds the neighbour's bytes
unchanged).  Tensors whose bytes are the very same (tied weights, which
``put_many`` stores once: ``_same``; a name given twice) are views of the
same bytes of the window, so a tie stays a tie; tensors whose bytes only
overlap each get a window of their own.  A later get or get_many never
sees such a write: the kept mapping drops a returned range's private
pages, and lends no range whose bytes are lent now.
The window lives while any tensor of the batch in it does; memory the
broker reuses meanwhile is never read through it, since no live view
covers it.
"""

from __future__ import annotations

import functools
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from .._errors import InvalidRequest, TensorBroken
from .._proto import INLINE_BATCH_MAX, INLINE_BATCH_MEAN, frame
from .._wire import MAX_BATCH, BatchGet, HandleColumns, ManyAlloc, ManyPublish, c_strides
from ..shm import UnsupportedDType, dtype_from_numpy
from ..shm._copy import copy_many
from ..shm._dlpack import Views, owned
from . import _cuda_handles, _cuda_ops
from ._checks import check_floors, check_mapping, check_names, check_timeout, check_ttl, check_wait
from ._core import Core
from ._extent import Layout, broken, check_allocations, check_columns, check_packs
from ._http import Offload, Op
from ._known import Known, filled, known, remember
from ._ops import tensor
from ._shmlane import again_many
from ._source import Source
from ._tensor import Publisher, SharedTensor, _Lease, _Owner
from ._tensormap import TensorMap
from ._windows import pack_window, windows

_NAMES: dict[Any, str] = {}  # numpy dtype -> our dtype name, for the arrays seen so far
_DTYPE, _SHAPE, _NBYTES = (operator.attrgetter(k) for k in ("dtype", "shape", "nbytes"))
_STEP = 256 << 20  # bytes copied between two progress reports


def _array_and_dtype(x: Any, name: str, opened: list[Source]) -> tuple[Any, str]:
    """What put_many copies from: numpy arrays as they are, anything else through ``Source``."""
    import numpy as np

    if type(x) is np.ndarray:
        found = _NAMES.get(x.dtype)
        if found is None:
            try:
                found = _NAMES[x.dtype] = dtype_from_numpy(x.dtype).name
            except UnsupportedDType:
                found = None  # Source says what is wrong
        if found is not None:
            return x, found
    src = Source(x, f"tensors[{name!r}]")
    opened.append(src)
    return src.array, src.dtype


def _host_dtypes(values: list[Any], device: Any) -> list[str] | None:
    """put_many's dtype names in one pass over the batch when every value is
    a numpy array of a dtype we store and no device is named (a state
    dict's usual case); None: look at each (``_array_and_dtype``)."""
    import numpy as np

    if device is not None or set(map(type, values)) != {np.ndarray}:
        return None
    dts = list(map(_DTYPE, values))
    known: dict[Any, str] = {}
    for dt in set(dts):
        found = _NAMES.get(dt)
        if found is None:
            try:
                found = _NAMES[dt] = dtype_from_numpy(dt).name
            except UnsupportedDType:
                return None  # Source says what is wrong, and for which name
        known[dt] = found
    return list(map(known.__getitem__, dts))


def put_many(core: Core, tensors: Mapping[str, Any], ttl: Any, device: Any) -> Op[dict[str, int]]:
    """Allocate all, copy all, publish all (or, failing or cancelled, give all back)."""
    check_mapping(tensors)
    ttl = check_ttl(ttl)
    values = list(tensors.values())
    dtypes = _host_dtypes(values, device)
    if dtypes is None and _cuda_handles.involves_gpu(values, device):
        op = _cuda_ops.put_many(core, tensors, device=device, ttl=ttl)
        return (yield Offload(core.run, op))  # type: ignore[no-any-return]
    if not tensors:
        return {}
    names = list(tensors)
    opened: list[Source] = []
    try:
        arrays = values
        if dtypes is None:
            arrays, dtypes = [], []
            for name in names:
                a, d = _array_and_dtype(tensors[name], name, opened)
                arrays.append(a)
                dtypes.append(d)
        shapes = [list(s) for s in map(_SHAPE, arrays)]
        return (
            yield from put_arrays(
                core, names, arrays, shapes, dtypes, ttl, same=_same(arrays, dtypes)
            )
        )
    finally:
        for src in opened:
            src.close()


def _same(arrays: list[Any], dtypes: list[str]) -> list[int] | None:
    """put_many's ``same`` column (``ManyAlloc``): per array, the position of
    an earlier one that views the very same bytes as it, in the same way
    (tied weights), or -1; None when no two do.  Views that only overlap are
    stored apart."""
    # Arrays that each own their memory share bytes only when they are one
    # array: then identity says it, without asking each for its address (a
    # dict built per call, most of a batch's cost for 1,000 small arrays).
    owners = all(a.flags.owndata for a in arrays if a.nbytes)
    if owners and len(set(map(id, arrays))) == len(arrays):
        return None  # no array twice
    seen: dict[Any, int] = {}
    same = [-1] * len(arrays)
    for i, a in enumerate(arrays):
        if a.nbytes:
            key = (
                id(a)
                if owners
                else (a.__array_interface__["data"][0], a.shape, a.strides, dtypes[i])
            )
            same[i] = seen.setdefault(key, i)
            if same[i] == i:
                same[i] = -1
    return same if max(same, default=-1) >= 0 else None


def put_arrays(
    core: Core,
    names: list[str],
    arrays: list[Any],
    shapes: list[list[int]],
    dtypes: list[str],
    ttl: float | None,
    progress: Callable[[int, int], None] | None = None,
    same: list[int] | None = None,
) -> Op[dict[str, int]]:
    """put_many's steps for host arrays: each array holds its tensor's bytes
    (C-ordered, of ``dtypes``; a flat uint8 array of them will do).
    ``progress(done, total)``: bytes copied so far, called as the copy goes.
    ``same``: see ``_same``; those arrays are stored once.

    A batch of more than ``MAX_BATCH`` names (the most one request carries)
    goes as several batches, in order, tied tensors together: each is all
    or nothing, so a failure leaves the batches before it published."""
    if len(names) > MAX_BATCH:
        placed: dict[str, int] = {}
        total = sum(a.nbytes for i, a in enumerate(arrays) if same is None or same[i] < 0)
        done = 0

        def told(d: int, _: int) -> None:
            if progress is not None:
                progress(done + d, total)

        for part in _parts(same, len(names)):
            local = {i: k for k, i in enumerate(part)}
            psame = None if same is None else [local[same[i]] if same[i] >= 0 else -1 for i in part]
            placed.update(
                (
                    yield from put_arrays(
                        core,
                        [names[i] for i in part],
                        [arrays[i] for i in part],
                        [shapes[i] for i in part],
                        [dtypes[i] for i in part],
                        ttl,
                        None if progress is None else told,
                        psame,
                    )
                )
            )
            done += sum(arrays[i].nbytes for i in part if same is None or same[i] < 0)
        return {n: placed[n] for n in names}
    body = ManyAlloc.model_construct(names=names, shapes=shapes, dtypes=dtypes, ttl=ttl, same=same)
    own = arrays if same is None else [a for i, a in enumerate(arrays) if same[i] < 0]
    carried = sum(map(_NBYTES, own))
    if progress is None and carried <= min(INLINE_BATCH_MAX, INLINE_BATCH_MEAN * len(own)):
        # Many small tensors ride in the request: one round trip, no mapping to fill.
        head = body.__pydantic_serializer__.to_json(body)
        try:  # C-ordered arrays are joined as they are, without a copy of each
            framed = frame(head, own)
        except (TypeError, ValueError, BufferError):  # one is not: its C-ordered copy
            framed = frame(head, [a.tobytes() for a in own])
        got = yield from core.call("POST", "/v1/many/put", framed, rid=core.rid())
        versions = got.get("versions") if isinstance(got, dict) else None
        if not isinstance(versions, list) or len(versions) != len(names):
            raise TensorBroken(
                f"the broker's answer to a put_many of {len(names)} tensor(s) does "
                f"not give one version per tensor: {str(got)[:200]}"
            )
        return dict(zip(names, versions, strict=True))
    cols = yield from core.alloc(body, HandleColumns, "/v1/many/alloc")
    try:
        # When it raises, no copy thread still writes.
        yield Offload(_fill, core, cols, arrays, shapes, dtypes, progress, same)
    except BaseException:
        yield from _abort(core, cols)
        raise
    try:
        yield from core.call(
            "POST",
            "/v1/many/publish",
            ManyPublish.model_construct(names=cols.names, versions=cols.versions),
            rid=core.rid(),
            raw=True,
            keep=True,
        )
    except BaseException:
        yield from _abort(core, cols)  # if the broker published them, it finds nothing to abort
        raise
    return dict(zip(cols.names, cols.versions, strict=True))


def _parts(same: list[int] | None, n: int) -> list[list[int]]:
    """Positions ``0..n-1`` in batches of at most ``MAX_BATCH``, each tensor
    in the batch of the tensor whose bytes it is (``same``)."""
    groups: dict[int, list[int]] = {}
    for i in range(n):
        j = -1 if same is None else same[i]
        groups.setdefault(i if j < 0 else j, []).append(i)
    parts: list[list[int]] = [[]]
    for group in groups.values():
        if len(group) > MAX_BATCH:
            raise InvalidRequest(
                f"{len(group)} names share one tensor's bytes; a batch holds at most {MAX_BATCH}"
            )
        if len(parts[-1]) + len(group) > MAX_BATCH:
            parts.append([])
        parts[-1].extend(group)
    return parts


def _fill(
    core: Core,
    cols: HandleColumns,
    arrays: list[Any],
    shapes: list[list[int]],
    dtypes: list[str],
    progress: Callable[[int, int], None] | None = None,
    same: list[int] | None = None,
) -> None:
    check_columns(cols)
    if cols.others or len(cols.names) != len(arrays):
        raise broken(f"a batch of {len(arrays)} tensor(s)", "it is not the batch asked for")
    flats = [core.segments.fill_flat(seg) for seg in cols.segments]
    check_packs(cols, [f.size for f in flats])
    check_allocations(cols, shapes, dtypes, [a.nbytes for a in arrays])
    packs = cols.packs
    pairs = []
    for i, (a, k, at) in enumerate(zip(arrays, cols.pack, cols.at, strict=True)):
        j = -1 if same is None else same[i]
        if j >= 0 and (cols.pack[j], cols.at[j]) == (k, at):
            continue  # the bytes of tensor j, copied there
        if a.nbytes:
            seg, base, _, _ = packs[k]
            off = base + at
            pairs.append((flats[seg][off : off + a.nbytes].view(a.dtype).reshape(a.shape), a))
    if progress is None:
        copy_many(pairs)
        return
    total, done, pending, group = sum(p[0].nbytes for p in pairs), 0, 0, []
    for i, pair in enumerate(pairs):  # in pieces of about _STEP bytes, each reported when copied
        group.append(pair)
        pending += pair[0].nbytes
        if pending >= _STEP or i == len(pairs) - 1:
            copy_many(group)
            done, pending, group = done + pending, 0, []
            progress(done, total)


def _abort(core: Core, cols: HandleColumns) -> Op[None]:
    # Not strict: columns that a check refused may differ in length.
    for name, version in zip(cols.names, cols.versions, strict=False):
        yield from core.abort(name, version)


def get_many(
    core: Core, names: Iterable[str], timeout: Any, newer_than: Any, until: Any = "all"
) -> Op[TensorMap]:
    """One request, one window per segment, a tensor per name, made when
    first read (``TensorMap``); ``until``: get_many's ``wait`` ("all" or
    "any").  More than ``MAX_BATCH`` names (the most one request carries)
    go as several requests under the one deadline: all of them, or an error
    and none."""
    names = check_names(names)
    wait = check_timeout(timeout)
    floors = check_floors(newer_than, names)
    how = check_wait(until)
    got = TensorMap()  # dropped, with its leases, if a later part fails
    if len(names) <= MAX_BATCH:
        yield from _get_batch(core, names, wait, floors, how, got)
        return got
    if how == "any":
        raise InvalidRequest(
            f"get_many(wait='any') waits on at most {MAX_BATCH} names; this "
            f"asks for {len(names)}: wait on fewer, or wait='all'"
        )
    deadline = None if wait is None else time.monotonic() + wait
    for k in range(0, len(names), MAX_BATCH):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        part = None if floors is None else floors[k : k + MAX_BATCH]
        yield from _get_batch(core, names[k : k + MAX_BATCH], left, part, how, got)
    return got


def _get_batch(
    core: Core,
    names: list[str],
    wait: float | None,
    floors: list[int] | None,
    until: Literal["all", "any"],
    into: TensorMap,
) -> Op[None]:
    entry = known(core.known, core.instance, names)  # kept: the answer may leave them out
    # The batch got last, whose lease this process holds again (``again_many``): no request.
    cols = None if entry is None or until != "all" else again_many(core, entry, floors)
    if cols is None:
        path = "/v1/many/get" if entry is None else f"/v1/many/get?known={entry.key}"
        session = core.session
        if (
            floors is not None
            and session is not None
            and session.floor_query
            and floors.count(floors[0]) == len(floors)
        ):
            # One floor for every name (a batch got again: each name's last
            # version), in the query: the body stays the same bytes from one
            # get to the next, and the broker parses it once (Route.kept).
            path += f"{'?' if entry is None else '&'}newer_than={floors[0]}"
            floors = None
        body = BatchGet.model_construct(names=names, timeout=wait, newer_than=floors, wait=until)
        io = None if wait is None else wait + core.timeout
        cols = yield from core.granted(HandleColumns, "POST", path, body, timeout=io)
    # From here on, whatever raises (Ctrl-C included) gives back the leases
    # that no object holds yet: the others go when their holders do.
    made: dict[int, _Lease] = {}  # the leases of the batch's packs, once made
    ready: dict[int, Any] = {}  # the tensors made now (GPU ones)
    try:
        if cols.key is None or not cols.versions:
            entry = None  # the answer has its columns
        elif not cols.names:
            cols = filled(entry, cols)
        elif entry is not None and cols.names is not entry.names:
            entry = None  # whole columns (of another key, maybe): checked, and kept
        if core.map_cheaply("cuda" if cols.others else "posix"):
            got = _got(core, cols, made, ready, entry)
        else:
            got = yield Offload(_got, core, cols, made, ready, entry)
    except BaseException:
        if core.bg is not None:
            held: set[int | None] = set(made)
            held.update(t._lease_id() for t in ready.values())
            lids = [p[3] for p in cols.packs] + [h.lease for h in cols.others.values()]
            for lid in dict.fromkeys(lids):
                if lid is not None and lid not in held:
                    core.bg.release_later(core.sid, lid)
        raise
    kept = got.known
    into.add(got, cols.names, ready, None if kept is None else kept.positions)
    if kept is not None:  # for the next get_many of the batch (again_many)
        good = cols.slots is not None and len(cols.packs) == 1 and cols.packs[0][3] is not None
        kept.last = (core.sid, cols) if good else None


class _Got:
    """A get_many's answer, checked and mapped: it makes the tensor at each
    position of the batch when asked (``TensorMap``)."""

    __slots__ = (
        "cols",
        "columns",
        "instance",
        "known",
        "layouts",
        "leases",
        "offsets",
        "owner",
        "owners",
        "ref",
        "sid",
        "strides",
        "windows",
    )

    def __init__(
        self,
        core: Core,
        cols: HandleColumns,
        layouts: list[Layout],
        leases: list[_Lease | None],
        offsets: list[int],
        windows: list[tuple[Any, Any, int]],
        known: Known | None = None,
    ) -> None:
        self.cols, self.layouts, self.leases, self.known = cols, layouts, leases, known
        self.offsets, self.windows = offsets, windows
        self.ref = weakref.ref[Publisher](core)  # the tensors' client, kept alive by none of them
        self.sid, self.instance = core.sid, core.instance
        self.strides = [c_strides(shape) for shape, _, _ in layouts]
        # What ``made`` reads per tensor, in one tuple: a tensor read alone
        # pays for one unpacking, not for a lookup of each.
        self.columns = (
            cols.names,
            cols.versions,
            cols.layout,
            cols.pack,
            layouts,
            windows,
            self.strides,
            offsets,
        )
        # What the tensors of one pack in one window share: the owner of
        # their views, and the window's flats owned by it, per (window,
        # pack); and the last of them, as a pack's tensors come in a row.
        self.owners: dict[tuple[int, int], tuple[_Owner, tuple[Any, Any] | None]] = {}
        self.owner: tuple[Any, int, _Owner, tuple[Any, Any] | None] = (
            None,
            -1,
            _Owner(None, None),
            (None, None),
        )

    def _owner_of(
        self, place: tuple[Any, Any, int], k: int, nbytes: int
    ) -> tuple[_Owner, tuple[Any, Any] | None]:
        """The owner of the views of pack ``k``'s tensors in ``place``, and
        the window's flats owned by it; no flats for a pack that one tensor
        of ``nbytes`` fills more than half of (a large tensor's block of its
        own): what they save is an array per tensor of a run, and a lone
        tensor's views are made from its address, by its owner."""
        key = (id(place), k)  # the places live as long as this batch
        got = self.owners.get(key)
        if got is None:
            window, flats, _ = place
            owner = _Owner(window, self.leases[k])
            if 2 * nbytes > self.cols.packs[k][2]:
                got = self.owners[key] = (owner, None)
            else:
                owned_flats = (owned(flats[0], owner), owned(flats[1], owner))
                got = self.owners[key] = (owner, owned_flats)
        return got

    def make(self, i: int) -> SharedTensor:
        """The tensor at position ``i``: ``made`` of one."""
        return self.made((i,))[0]

    def made(self, positions: Iterable[int]) -> list[SharedTensor]:
        """The tensors at ``positions`` of the batch, new objects, in one loop."""
        names, versions, layout, pack, layouts, windows, strides, offsets = self.columns
        ref, sid, instance, of = self.ref, self.sid, self.instance, SharedTensor._of
        last, lk, owner, owned_flats = self.owner
        out = []
        # The tensors of one layout over one of the owned flats: their
        # arrays are made together, when the first is exported (Views).
        runs: dict[tuple[int, int], Views] = {}
        run: Views | None = None
        offs: list[int] = []
        lm = -1
        for i in positions:
            m = layout[i]
            shape, dt, nbytes = layouts[m]
            place = windows[i]
            window, _, base = place
            k = pack[i]
            if place is not last or k != lk:
                owner, owned_flats = self._owner_of(place, k, nbytes)
                last, lk, lm = place, k, -1
            at = offsets[i] - base
            t = of(
                ref,
                names[i],
                versions[i],
                shape,
                strides[m],
                dt,
                nbytes,
                window,
                owned_flats,
                at,
                owner,
                sid,
                instance,
            )
            if owned_flats is not None:  # its array is made with its run's (Views)
                if m != lm:
                    run = runs.get((id(owned_flats), m))
                    if run is None:
                        run = runs[id(owned_flats), m] = Views(owned_flats[1], shape, dt)
                    offs, lm = run.offsets, m
                t._views, t._views_k = run, len(offs)
                offs.append(at)
            out.append(t)
        self.owner = (last, lk, owner, owned_flats)
        return out


def _got(
    core: Core,
    cols: HandleColumns,
    made: dict[int, _Lease],
    ready: dict[int, Any],
    entry: Known | None = None,
) -> _Got:
    """The batch of ``cols``, checked and mapped, with a lease object per
    pack (into ``made``, each as soon as it exists) and its GPU tensors made
    (into ``ready``).  ``entry``: the kept columns ``cols`` were filled
    from (``_known``: checked when they came), else they are checked here
    and kept if the broker named them by a key."""
    bg, sid = core.bg, core.sid
    if entry is None:
        layouts = check_columns(cols)
        entry = remember(core.known, core.instance, cols, layouts)
        offsets, places = windows(core, cols, layouts)
    else:
        layouts = entry.checked
        offsets, places = pack_window(core, cols, entry)
    release = None if bg is None else functools.partial(bg.release_later, sid)
    leases: list[_Lease | None] = []
    with core.gate:  # no fork while leases are registered
        for _, _, _, lid in cols.packs:
            lease = None
            if lid is not None and release is not None:
                lease = made.get(lid)
                if lease is None:
                    lease = made[lid] = _Lease(lid, release)
                    bg.track(sid, lid)  # type: ignore[union-attr]
            leases.append(lease)
    for i, h in cols.others.items():  # tensor() takes the gate itself
        ready[i] = tensor(core, h, False)
    return _Got(core, cols, layouts, leases, offsets, places, entry)
