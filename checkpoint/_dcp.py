"""DCP storage in a broker: how a checkpoint is laid out, saved and loaded.

A checkpoint ``ID`` (a name prefix, such as ``run1/step-100``) is:

* ``ID/SAVE/RANK/K``: the K-th item of a rank's save plan, one tensor each
  (a tensor shard as it is, in its dtype; bytes DCP pickled, as uint8).
  ``SAVE`` is 32 hex digits, new for each save: a save never overwrites the
  tensors of another.
* ``ID/.metadata``: DCP's ``Metadata``, pickled (as uint8), naming the
  tensors above (``Stored``).  The coordinator's ``finish`` puts it last, once
  every rank's tensors are published; so a checkpoint whose metadata exists
  is complete, and a save that dies midway leaves the previous one (its
  metadata and the tensors that names) as it was.  A save that finishes then
  deletes what earlier saves of the same ID left under ``ID/`` (finished or
  not); readers holding them keep their bytes until they let go.

Each rank writes its items in one ``put_many`` (tensors two names share, as
tied weights, stored once), and reads its items in one ``get_many``.
``load`` copies into the destination tensors, as DCP's planners expect,
unless the planner is a ``ZeroCopyLoadPlanner``: then each destination that
an item covers whole (same shape, dtype and device; a DTensor's local shard)
is replaced by a view of the broker's bytes, read-only in effect (a stray write stays in the
loading process), which ``load_state_dict(..., assign=True)`` then adopts.

Metadata is unpickled with only the classes a DCP ``Metadata`` holds (DCP's
metadata types, torch dtypes, layouts and memory formats, ``torch.Size``,
``Stored`` and builtin containers): a name that can be written can never
run code in a loading process.

Without ``use_collectives``, every rank writes its own metadata,
``ID/.metadata.RANK``, and reads its own.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import threading
import uuid
from collections.abc import Sequence
from typing import Any

try:
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import (
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        WriteItemType,
    )
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.distributed.tensor import DTensor
    from torch.futures import Future
    from torch.utils.dlpack import from_dlpack
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"tensordepot.checkpoint needs torch with torch.distributed ({exc}); pip install torch"
    ) from exc

import numpy as np

from .._errors import InvalidRequest, TensorBroken, TensorNotFound
from .._wire import check_name
from ..client import Client

_META = ".metadata"
_SAVE = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one item of a checkpoint lives (DCP's ``storage_data``): the
    tensor ``name``, of ``nbytes`` bytes."""

    name: str
    nbytes: int


_clients: dict[tuple[str | None, str | None], Client] = {}
_lock = threading.Lock()


class _Broker:
    """The client a writer or reader uses: the one given, else this
    process's client for ``url`` and ``token``, made on first use and kept
    for the life of the process (as unpickling keeps one), so that a save or
    a load opens no session of its own."""

    def __init__(self, client: Client | None, url: str | None, token: str | None) -> None:
        self._given, self._key = client, (url, token)

    def client(self) -> Client:
        if self._given is not None:
            return self._given
        with _lock:
            c = _clients.get(self._key)
            if c is None or c._closed:
                c = _clients[self._key] = Client(self._key[0], token=self._key[1])
            return c


def _checked_id(checkpoint_id: Any) -> str:
    cid = str(checkpoint_id) if checkpoint_id is not None else ""
    if not cid:
        raise InvalidRequest(
            "a checkpoint needs an id, a name prefix such as 'run1/step-100': "
            "DepotWriter('run1/step-100'), or dcp.save(..., checkpoint_id=)"
        )
    check_name(f"{cid.rstrip('/')}/{_META}", "checkpoint id")
    return cid.rstrip("/")


def _meta_name(cid: str, rank: int | None) -> str:
    return f"{cid}/{_META}" if rank is None else f"{cid}/{_META}.{rank}"


class DepotWriter(StorageWriter):
    """DCP's ``StorageWriter`` into a broker: ``dcp.save(state_dict,
    storage_writer=DepotWriter("run1/step-100"))``.

    ``client``: the ``Client`` to use; else this process's client of ``url``
    (default ``$TENSORDEPOT_URL``, then the default socket) and ``token``,
    made on first use and kept.  ``overwrite``: replace a checkpoint of this
    id (default: refuse, ``InvalidRequest``).  ``ttl``: delete the
    checkpoint's tensors this many seconds after they are put."""

    def __init__(
        self,
        checkpoint_id: str | None = None,
        *,
        client: Client | None = None,
        url: str | None = None,
        token: str | None = None,
        overwrite: bool = False,
        ttl: float | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_id = _checked_id(checkpoint_id) if checkpoint_id else ""
        self.overwrite, self.ttl = overwrite, ttl
        self._broker = _Broker(client, url, token)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator, self.rank, self.use_collectives = True, None, True

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save (DCP calls it first), of ``checkpoint_id`` if given."""
        if checkpoint_id:
            self.checkpoint_id = _checked_id(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Whether ``checkpoint_id`` can name a checkpoint (a name prefix)."""
        try:
            _checked_id(checkpoint_id)
        except InvalidRequest:
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """This rank's part: coordinator or not, its rank, with collectives or not."""
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint id and this save's id, recorded in the metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def _refuse_existing(self, rank: int | None) -> None:
        if self.overwrite:
            return
        name = _meta_name(self._id(), rank)
        if any(i.name == name for i in self._broker.client().list(prefix=name)):
            raise InvalidRequest(
                f"checkpoint {self.checkpoint_id!r} exists already ({name!r}); "
                f"save under a new id, delete it (tensordepot rm --prefix "
                f"{self.checkpoint_id}/), or pass DepotWriter(..., "
                f"overwrite=True)"
            )

    def _id(self) -> str:
        if not self.checkpoint_id:
            raise InvalidRequest(
                "DepotWriter has no checkpoint id: DepotWriter('run1/step-100')"
                ", or dcp.save(..., checkpoint_id=)"
            )
        return self.checkpoint_id

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Without collectives: refuse an existing checkpoint, and name this rank's tensors."""
        if not self.use_collectives:  # each rank plans alone: it names its own tensors
            self._refuse_existing(self.rank)
            plan = dataclasses.replace(plan, storage_data=self._prefix(self.rank or 0))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: refuse an existing checkpoint (unless ``overwrite``)
        and give each rank's tensors their names' prefix."""
        if self.use_collectives:
            self._refuse_existing(None)
        return [
            p
            if p.storage_data is not None
            else dataclasses.replace(p, storage_data=self._prefix(i))
            for i, p in enumerate(plans)
        ]

    def _prefix(self, rank: int) -> str:
        return f"{self._id()}/{self.save_id}/{rank}"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Put every item of this rank's plan, in one ``put_many``."""
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            raise InvalidRequest(
                "DepotWriter.write_data needs the plan its prepare_global_plan "
                "(or prepare_local_plan) made"
            )
        tensors: dict[str, Any] = {}
        results = []
        for k, item in enumerate(plan.items):
            name = f"{prefix}/{k}"
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                value: Any = np.frombuffer(data.getvalue(), np.uint8)
                nbytes = value.nbytes
            else:
                value = data.detach()
                nbytes = value.nbytes
            tensors[name] = value
            results.append(
                WriteResult(
                    index=item.index, size_in_bytes=nbytes, storage_data=Stored(name, nbytes)
                )
            )
        if tensors:
            self._broker.client().put_many(tensors, ttl=self.ttl, device="cpu")
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Put the metadata, last: from now on the checkpoint is there, whole."""
        cid = self._id()
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        blob = np.frombuffer(pickle.dumps(metadata), np.uint8)
        rank = None if self.use_collectives else self.rank
        c = self._broker.client()
        c.put_many({_meta_name(cid, rank): blob}, ttl=self.ttl)
        self._drop_earlier_saves(c, cid, rank)

    def _drop_earlier_saves(self, c: Client, cid: str, rank: int | None) -> None:
        """What earlier saves of this id left (finished or not): the tensors
        of another save id under ``cid/`` (``rank``: of that rank only)."""
        old = set()
        for info in c.list(prefix=f"{cid}/"):
            parts = info.name[len(cid) + 1 :].split("/")
            if (
                len(parts) == 3
                and _SAVE.fullmatch(parts[0])
                and parts[0] != self.save_id
                and (rank is None or parts[1] == str(rank))
            ):
                old.add("/".join([cid, *parts[: 1 if rank is None else 2]]) + "/")
        for prefix in sorted(old):  # one request each, which another save may have beaten
            c.delete(prefix=prefix)


class _MetadataUnpickler(pickle.Unpickler):
    """Only what a DCP ``Metadata`` holds (the module docstring): an exact
    allow-list of (module, name) pairs.

    Pickle protocol 4 resolves a dotted name attribute by attribute
    (``("os", "path.join")``), so a name with a dot is refused before any
    lookup, and no module is allowed as a whole: a module's attributes
    include what it imported (``os``, ``pickle``, ``builtins``)."""

    _ALLOWED = frozenset(
        {
            *(
                ("torch.distributed.checkpoint.metadata", n)
                for n in (
                    "Metadata",
                    "MetadataIndex",
                    "StorageMeta",
                    "TensorProperties",
                    "TensorStorageMetadata",
                    "BytesStorageMetadata",
                    "ChunkStorageMetadata",
                    "_MEM_FORMAT_ENCODING",
                )
            ),
            (__name__, "Stored"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
            ("copyreg", "_reconstructor"),
            ("collections", "OrderedDict"),
            *(
                ("builtins", n)
                for n in ("dict", "list", "tuple", "set", "frozenset", "slice", "object")
            ),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            if module == "torch":  # dtypes, layouts and memory formats, and nothing else
                found = torch.__dict__.get(name)
                if isinstance(found, torch.dtype | torch.layout | torch.memory_format):
                    return found
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a DCP checkpoint's metadata; refused"
        )


class DepotReader(StorageReader):
    """DCP's ``StorageReader`` from a broker: ``dcp.load(state_dict,
    storage_reader=DepotReader("run1/step-100"))``.

    ``client``, ``url``, ``token``: as ``DepotWriter``'s.  ``timeout``: wait
    this many seconds for the checkpoint to appear (its metadata; default 0:
    it must be there; None waits for ever)."""

    def __init__(
        self,
        checkpoint_id: str | None = None,
        *,
        client: Client | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float | None = 0.0,
    ) -> None:
        super().__init__()
        self.checkpoint_id = _checked_id(checkpoint_id) if checkpoint_id else ""
        self.timeout = timeout
        self._broker = _Broker(client, url, token)
        self.storage_data: dict[Any, Stored] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new load (DCP calls it first), of ``checkpoint_id`` if given."""
        self.storage_data = {}
        if checkpoint_id:
            self.checkpoint_id = _checked_id(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Whether ``checkpoint_id`` can name a checkpoint (a name prefix)."""
        return DepotWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (waiting up to ``timeout`` for it to appear)."""
        if not self.checkpoint_id:
            raise InvalidRequest(
                "DepotReader has no checkpoint id: DepotReader('run1/step-100')"
                ", or dcp.load(..., checkpoint_id=)"
            )
        name = _meta_name(self.checkpoint_id, kwargs.get("rank"))
        c = self._broker.client()
        try:
            t = c.get(name, timeout=self.timeout)
        except TensorNotFound:
            raise TensorNotFound(
                f"no checkpoint {self.checkpoint_id!r} in the broker: its metadata {name!r} "
                f"is not there (a save that never finished puts none); tensordepot ls "
                f"--prefix {self.checkpoint_id}/ lists what is"
            ) from None
        try:
            blob = t.numpy().tobytes()
        finally:
            t.release()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
        except Exception as exc:
            raise TensorBroken(f"{name!r} is not a DCP checkpoint's metadata ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise TensorBroken(
                f"{name!r} is not a DCP checkpoint's metadata (it holds a "
                f"{type(metadata).__name__})"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Where each item lives, from the metadata (a DepotWriter's, or refused)."""
        data = metadata.storage_data
        if not isinstance(data, dict) or not all(isinstance(v, Stored) for v in data.values()):
            raise TensorBroken(f"checkpoint {self.checkpoint_id!r} was not saved by DepotWriter")
        self.storage_data = data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """One ``get_many`` for the rank's items, then each into its destination."""
        names = sorted({self.storage_data[r.storage_index].name for r in plan.items})
        c = self._broker.client()
        try:
            got = c.get_many(names) if names else {}
        except TensorNotFound as exc:
            raise TensorNotFound(
                f"checkpoint {self.checkpoint_id!r} lacks tensors its "
                f"metadata names (deleted, or replaced by a later save "
                f"while this load ran): {exc}"
            ) from None
        adopt = planner.adopt if isinstance(planner, ZeroCopyLoadPlanner) else None
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            t = got[stored.name]
            if t.nbytes != stored.nbytes:
                raise TensorBroken(
                    f"{stored.name!r} holds {t.nbytes} bytes, not the "
                    f"{stored.nbytes} checkpoint {self.checkpoint_id!r} "
                    f"saved"
                )
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(t.numpy().tobytes()))
                continue
            src = _narrowed(from_dlpack(t), req.storage_offsets, req.lengths)
            if adopt is not None and adopt(req, src):
                continue
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise TensorBroken(
                    f"{stored.name!r} is {tuple(src.size())} where the plan "
                    f"expects {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _narrowed(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != t.size(dim):
            t = t.narrow(dim, off, n)
    return t


class ZeroCopyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a destination tensor which a
    checkpoint item covers whole (same shape, dtype, CPU) is replaced in the
    state dict by the broker's own bytes instead of being copied into; for a
    DTensor, its local shard (the DTensor is rebuilt around it, with its mesh
    and placements).  Load a model with
    ``model.load_state_dict(state["model"], assign=True)`` afterwards to keep
    them.  The tensors are read-only in effect: a write through them stays in
    this process.  What an item covers only in part (a checkpoint saved with
    another sharding) is copied, as DCP does."""

    def adopt(self, req: ReadItem, src: torch.Tensor) -> bool:
        """Put ``src`` in the state dict for ``req``'s destination, if it covers it whole."""
        fqn = req.dest_index.fqn
        dest = self.state_dict.get(fqn)
        if not isinstance(dest, torch.Tensor) or any(req.dest_offsets):
            return False
        if type(dest) is DTensor:
            local = dest.to_local()
            if not _same(local, src):
                return False
            src = DTensor.from_local(
                src,
                dest.device_mesh,
                dest.placements,
                run_check=False,
                shape=dest.shape,
                stride=dest.stride(),
            )
        elif type(dest) not in (torch.Tensor, torch.nn.Parameter) or not _same(dest, src):
            return False
        self.state_dict[fqn] = src
        if self.flatten_state_dict and fqn in self.mappings:
            set_element(self.original_state_dict, self.mappings[fqn], src)
        elif fqn in self.original_state_dict:
            self.original_state_dict[fqn] = src
        return True


def _same(dest: torch.Tensor, src: torch.Tensor) -> bool:
    return dest.shape == src.shape and dest.dtype == src.dtype and dest.device == src.device


def push(
    checkpoint_id: str,
    to: str,
    *,
    client: Client | None = None,
    url: str | None = None,
    token: str | None = None,
    tls_ca: str | bytes | None = None,
) -> int:
    """Send checkpoint ``checkpoint_id`` from this host's broker (``client``,
    or ``url``) to the broker on another host whose Flight endpoint is ``to``
    (``grpc://HOST:PORT``), its metadata last, so that ``DepotReader`` on
    that host finds it only once it is whole.  ``token`` (default
    ``$TENSORDEPOT_PEER_TOKEN``) needs write scope there.  Returns the number
    of tensors sent."""
    cid = _checked_id(checkpoint_id)
    c = _Broker(client, url, None).client()
    metadata = DepotReader(cid, client=c).read_metadata()
    names = sorted({s.name for s in metadata.storage_data.values()})
    for name in [*names, _meta_name(cid, None)]:
        c.push(name, to, token=token, tls_ca=tls_ca)
    return len(names) + 1
