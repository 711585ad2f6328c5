"""What crosses HTTP: frozen pydantic models imported by both the broker and
the client, so nothing is defined twice.  Handles describe memory and never
carry the tensor's bytes (a small tensor's bytes ride in the body of
``POST /v1/put/{name}`` and ``/v1/many/put``, never in a model).

It is long (over 600 lines), on purpose: every model that crosses HTTP is
here, and only here, so that the broker and the client can never disagree
on one."""

from __future__ import annotations

import base64
import binascii
import inspect
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ._errors import InvalidRequest, InvalidType

# A tensor name: printable ASCII without spaces, up to 512 characters.
# Dots and slashes are fine ("model.layers.0.weight", "run/1/w").
NAME_PATTERN = r"^[\x21-\x7e]{1,512}$"
NAME_RULE = "1 to 512 printable ASCII characters, no spaces"


def is_name(name: str) -> bool:
    """Whether ``name`` is a valid tensor name (``NAME_RULE``, ``NAME_PATTERN``):
    ASCII, printable (no control character: ``\\n``, ``\\t``, NUL, DEL, ...),
    no space, 1 to 512 characters.  String methods and a memory of the names
    passed, not a regex: a batch checks every name at each step.  (Never
    ``re.match(...$)``: Python's ``$`` also matches before a trailing newline,
    so "w\\n" would pass and then name another tensor at a door that cuts the
    path at the newline.)"""
    if name in _NAMES_SEEN:
        return True
    good = 0 < len(name) <= 512 and name.isascii() and name.isprintable() and " " not in name
    if good and len(_NAMES_SEEN) < 16384:  # names repeat (a state dict's, step after step)
        _NAMES_SEEN.add(name)
    return good


_NAMES_SEEN: set[str] = set()  # names is_name passed: at most 16384, 8 MiB at worst


def check_name(name: Any, what: str = "name") -> str:
    """The one tensor-name check, for the client, both HTTP doors and Flight:
    ``name`` back, or ``InvalidRequest`` (400; ``InvalidType`` for a non-str)
    saying what was given and what is allowed.  Control characters (``\\n``,
    ``\\t``, NUL, ...), spaces and non-ASCII are refused."""
    if not isinstance(name, str):
        raise InvalidType(
            f"{what} must be a str ({NAME_RULE}), not {type(name).__name__} {_shown(name)}"
        )
    if not is_name(name):
        raise InvalidRequest(f"{what} {_shown(name)} is not a valid tensor name: use {NAME_RULE}")
    return name


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _valid_name(name: str) -> str:
    return check_name(name, "tensor name")


def known_names(names: list[Any]) -> bool:
    """Whether every one of ``names`` passed ``is_name`` before: a batch's
    names (a state dict's, step after step) pass in one set operation, as a
    call per name costs more than the check.  False says nothing: check each."""
    try:
        return _NAMES_SEEN.issuperset(names)
    except TypeError:  # unhashable: not a name
        return False


def _valid_names(names: list[str]) -> list[str]:
    """A batch's names, checked in one call for the list."""
    if not known_names(names):
        for i, name in enumerate(names):
            check_name(name, f"item {i}:")
    return names


# A name in a model checks itself with ``check_name``: the broker answers a
# bad one with that InvalidRequest (400), as for a name in a path
# (service/_http/_handler.py ``invalid``).  The schema shows the same rule.
Name = Annotated[
    str,
    AfterValidator(_valid_name),
    Field(json_schema_extra={"pattern": NAME_PATTERN}, examples=["model.layers.0.weight"]),
]
MAX_NDIM = 32
MAX_BATCH = 10_000
# A batch's column of names: the same check (``check_name``, named by its index).
Names = Annotated[
    list[Annotated[str, Field(json_schema_extra={"pattern": NAME_PATTERN})]],
    AfterValidator(_valid_names),
    Field(max_length=MAX_BATCH),
]
INLINE_MAX = 256 * 1024  # bytes; larger tensors go through alloc + publish


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a C-ordered tensor of ``shape`` (a
    handle's ``strides``): what the broker sends and the client builds views
    with.  State dicts repeat a few shapes: kept, up to a bound."""
    strides = _STRIDES.get(shape)
    if strides is None:
        acc, out = 1, []
        for dim in reversed(shape):
            out.append(acc)
            acc *= max(dim, 1)
        strides = tuple(reversed(out))
        if len(_STRIDES) < 4096:
            _STRIDES[shape] = strides
    return strides


class _Frozen(BaseModel):
    """What a client sends: unknown fields are refused (422), never ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class _Answer(BaseModel):
    """What the broker sends: a client ignores fields a newer broker added."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class ErrorDetail(_Answer):
    code: str = Field(examples=["not_found"])
    message: str = Field(
        examples=["tensor 'w' not found (known: a, b); did the producer publish it?"]
    )


class ErrorBody(_Answer):
    error: ErrorDetail


class SessionOpen(_Frozen):
    pid: int = Field(ge=1, description="the client's pid, as it sees itself")
    start_time: int | None = Field(None, ge=0, description="field 22 of /proc/<pid>/stat")
    label: str | None = Field(None, max_length=200)
    holding: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=64,
        description="earlier sessions of this process that lapsed (it was paused) and whose "
        "leases its views still hold: their memory stays retired while it lives",
    )


class LaneInfo(_Answer):
    """The answer to ``POST /v1/lane``; the lane itself (a memfd and two
    eventfds) comes with it as ``SCM_RIGHTS`` (docs/plan-lane.md)."""

    requests: int = Field(description="the bytes of the request ring")
    answers: int = Field(description="the bytes of the answer ring")


class SessionInfo(_Answer):
    session: str
    pid: int | None
    tracked: bool = Field(
        description="liveness checked through the pid (SO_PEERCRED); else by heartbeat"
    )
    heartbeat_interval: float | None = Field(description="send heartbeats this often (s), or never")
    instance: str = Field(
        "",
        max_length=64,
        description="this run of the broker: versions start again at 1 in another",
    )
    floor_query: bool = Field(
        False,
        description="get_many takes newer_than in its query too (one version for every "
        "name); a broker without it reads only the body's",
    )


class ForkInfo(_Answer):
    """A session made for a child process about to be forked, holding copies
    of the parent's leases, so that the views the child inherits stay valid.
    The child claims it (POST /v1/sessions/{session}/claim) within the claim
    window, or it ends and its memory is retired."""

    session: str
    leases: dict[str, int] = Field(description="the parent's lease id -> the child's")
    claim_within: float = Field(description="seconds the child has to claim the session")


class AllocRequest(_Frozen):
    name: Name
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_NDIM)
    dtype: str = Field(max_length=40, examples=["float32", "bfloat16"])
    device: str = Field("cpu", max_length=64)
    ttl: float | None = Field(
        None, gt=0, description="delete the tensor this many seconds after publish"
    )
    hold: bool = Field(
        False,
        description="also take a lease for the writer's own views, which "
        "keeps the memory theirs after publish, delete or "
        "supersede",
    )


IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
GPU_UUID = r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def encode_ipc(raw: bytes) -> str:
    """A CUDA IPC handle (64 opaque bytes) as it crosses HTTP: base64."""
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
    return base64.b64encode(raw).decode("ascii")


def decode_ipc(text: str) -> bytes:
    """The 64 bytes of a CUDA IPC handle from its base64 text."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("a CUDA IPC handle is base64 text") from None
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
    return raw


def _valid_ipc(text: str) -> str:
    decode_ipc(text)
    return text


IpcHandle = Annotated[
    str,
    AfterValidator(_valid_ipc),
    Field(description="a 64-byte CUDA IPC handle, base64", min_length=88, max_length=88),
]
GpuUuid = Annotated[
    str, Field(pattern=GPU_UUID, examples=["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"])
]


class CudaHandle(_Answer):
    """What a process needs to open a CUDA tensor: the block's IPC handle and
    the broker's interprocess events.  Offsets are in ``Handle.offset``."""

    uuid: GpuUuid = Field(description="the GPU; each process maps it to its own ordinal")
    ipc_handle: IpcHandle = Field(description="cudaIpcMemHandle_t of the whole block")
    block_size: int = Field(ge=0, description="bytes in the block the handle maps")
    event: int | None = Field(None, description="id of the write event: wait on it before reading")
    event_handle: IpcHandle | None = None
    release_event: int | None = Field(
        None,
        description="id of this lease's event: record it on "
        "every stream that used the tensor, then release",
    )
    release_event_handle: IpcHandle | None = None
    owner_pid: int | None = Field(
        None, description="share(): the producer's pid (memory dies with it)"
    )
    owner_start: int | None = Field(
        None, description="share(): the producer's start time (/proc stat 22)"
    )


class Handle(_Answer):
    """Where a tensor version lives.  Metadata only."""

    name: str
    version: int
    kind: Literal["posix", "cuda"]
    segment: str
    offset: int
    nbytes: int
    shape: list[int]
    strides: list[int] = Field(description="in elements")
    dtype: str
    device: str
    state: Literal["writing", "ready"]
    lease: int | None = Field(None, description="release it when done (get, and alloc with hold)")
    cuda: CudaHandle | None = Field(None, description="kind 'cuda' only")
    slot: int | None = Field(
        None,
        description="where the broker's board of newest versions (passed with a lane) "
        "shows this name's newest version number",
    )


class PublishRequest(_Frozen):
    name: Name
    version: int = Field(ge=1)


class LinkRequest(_Frozen):
    name: Name
    lease: int = Field(description="a lease this session holds on the source version")
    ttl: float | None = Field(None, gt=0)
    source: Name | None = Field(
        None,
        description="the source's name: needed when the lease holds several versions "
        "(a get_many's lease of a pack)",
    )


class ReleaseRequest(_Frozen):
    leases: list[int] = Field(default_factory=list, max_length=MAX_BATCH * 10)
    requests: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=MAX_BATCH,
        description="request ids whose answers were never read: their leases are released "
        "and their waits cancelled",
    )
    stale: dict[Annotated[str, Field(max_length=64)], list[int]] = Field(
        default_factory=dict,
        max_length=64,
        description="leases of this client's earlier sessions that lapsed (it was paused past "
        "--session-ttl), whose views are gone now: their retired memory may be reused",
    )


class _Described(type(BaseModel)):  # type: ignore[misc]  # pydantic's ModelMetaclass
    """The metaclass of the answers users read (``TensorInfo``, ``Stat``,
    ``DeviceStat``), so that ``help()`` explains them.

    Each field is described once, in its ``Field(description=...)`` (which the
    OpenAPI schema shows too); the class docstring gets a "Fields" list made
    from those.  pydoc lists what ``dir(cls)`` returns: here only the class's
    own public names, not the machinery every pydantic model inherits.
    Instances are unaffected (``dir(obj)`` reads the class namespaces
    directly), and so is pydantic, which never asks ``dir()`` of a model."""

    def __init__(cls, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        hints = cls.__annotations__  # strings (postponed annotations): "int | None"
        fields = "\n".join(
            f"- ``{name}`` ({hints.get(name, 'see base class')}): {f.description}"
            for name, f in cls.model_fields.items()
        )
        cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nFields:\n\n{fields}\n"

    def __dir__(cls) -> list[str]:
        return sorted(n for n in vars(cls) if not n.startswith("_") and n != "model_config")


class TensorInfo(_Answer, metaclass=_Described):
    """One name with its newest version, as ``Client.list()`` and ``tensordepot ls`` show it.

    A frozen pydantic model: ``model_dump()`` gives a dict."""

    name: str = Field(description="the tensor's name")
    version: int = Field(description="the newest version's number (versions only grow)")
    shape: list[int] = Field(description="dimensions, outermost first")
    dtype: str = Field(description='element type, such as "float32" or "bfloat16"')
    nbytes: int = Field(description="bytes of that version")
    device: str = Field(description='where its bytes live: "cpu", or "cuda:GPU-<uuid>"')
    state: Literal["writing", "ready"] = Field(
        description='"ready" once published; "writing" while only an unpublished version exists'
    )
    readers: int = Field(description="live leases on this name's versions")
    expires_in: float | None = Field(
        None, description="seconds until its ttl deletes the name; None without a ttl"
    )
    origin: str | None = Field(
        None,
        description="for a replica pulled from a peer: the Flight URL "
        "of the broker where the tensor was published",
    )
    origin_version: int | None = Field(None, description="for a replica: its version at the origin")


class DeviceStat(_Answer, metaclass=_Described):
    """One GPU's memory, as the broker holds it (``Stat.devices``).

    A frozen pydantic model: ``model_dump()`` gives a dict."""

    device: str = Field(
        description="the GPU, cuda:GPU-<uuid>",
        examples=["cuda:GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"],
    )
    bytes_in_use: int = Field(description="bytes of broker blocks held by tensor versions")
    bytes_reserved: int = Field(
        description="device memory the broker allocated, warm free space included"
    )
    bytes_pending: int = Field(description="freed bytes waiting for readers' kernels to finish")
    bytes_shared: int = Field(description="producer-owned bytes published with share()")
    max_memory: int = Field(description="--cuda-memory for this GPU")
    segments: int = Field(description="device allocations (pooled blocks) the broker holds")
    events: int = Field(description="interprocess events the broker created on this GPU")
    context_bytes: int | None = Field(
        description="device memory the broker's CUDA context took "
        "(NVML, measured when it was created); None if unknown"
    )


class Stat(_Answer, metaclass=_Described):
    """The broker's accounting, as ``Client.stat()`` and ``tensordepot stat`` show it.

    A frozen pydantic model: ``model_dump()`` gives a dict."""

    bytes_in_use: int = Field(description="bytes held by tensor versions, pending deletes included")
    bytes_reserved: int = Field(
        description="bytes of shared memory the broker holds, warm free space included"
    )
    bytes_retired: int = Field(
        0,
        description="bytes the broker will never reuse because a process "
        "it cannot vouch for may still map them; freed with "
        "their segment",
    )
    retired_total: int = Field(0, description="bytes retired since the broker started")
    max_memory: int = Field(
        description="shared memory the broker may hold (--max-memory), in bytes"
    )
    tensors: int = Field(description="names with a published version")
    versions: int = Field(
        description="versions alive: the newest of each name, older ones still "
        "read, and unpublished ones"
    )
    leases: int = Field(description="leases held: each get takes one, and so does empty()")
    sessions: int = Field(description="open client sessions")
    segments: int = Field(description="shared-memory segments the broker holds")
    waiting: int = Field(0, description="gets parked now, waiting for a publish")
    devices: list[DeviceStat] = Field(
        default_factory=list, description="GPUs in use (none until first used)"
    )


class ShareRequest(_Frozen):
    """Publish producer-owned CUDA memory (``Client.share``): no copy."""

    name: Name
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_NDIM)
    dtype: str = Field(max_length=40)
    device: str = Field(max_length=64, examples=["cuda:GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"])
    ipc_handle: IpcHandle
    offset: int = Field(ge=0, description="the tensor's byte offset in the allocation")
    alloc_size: int = Field(gt=0, description="bytes in the allocation the handle maps")
    ttl: float | None = Field(None, gt=0)


class LiveRequest(_Frozen):
    segments: list[Annotated[str, Field(max_length=256)]] = Field(max_length=MAX_BATCH)


class LiveReply(_Answer):
    live: list[str] = Field(
        description="those the broker still has (a block, or a shared allocation)"
    )
    busy: list[str] = Field(description="those some lease, or a reader's queued kernel, still uses")
    orphaned: list[str] = Field(
        default_factory=list, description="shared allocations whose producer has died or closed"
    )


class BatchGet(_Frozen):
    names: Names
    timeout: float | None = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="one deadline for the whole batch, in seconds; null: forever",
    )
    newer_than: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=MAX_BATCH,
        description="per name, in the same order: only a version newer than this (waits for it)",
    )
    wait: Literal["all", "any"] = Field(
        "all",
        description='"all": until every name has a version newer than its newer_than; '
        '"any": until one has, then the newest ready version of every name',
    )


def check_prefix(prefix: Any) -> str:
    """The one check of a name prefix (lists and deletes by prefix, both
    clients and the broker): the start of a name, under the name rule."""
    return check_name(prefix, "prefix")


class ManyDelete(_Frozen):
    """Names to delete at once: every one of ``names`` (or, one missing, none),
    or every name that starts with ``prefix``; exactly one of the two."""

    names: Names | None = None
    prefix: Annotated[str, AfterValidator(check_prefix)] | None = Field(
        None,
        json_schema_extra={"pattern": NAME_PATTERN},
        examples=["run1/"],
        description="delete every name that starts with this",
    )

    def model_post_init(self, _: Any) -> None:
        if (self.names is None) == (self.prefix is None):
            raise InvalidRequest("a delete names either names or a prefix (one of the two)")


class Deleted(_Answer):
    names: list[str] = Field(description="the names deleted, in order")


class ManyAlloc(_Frozen):
    """A state dict's allocations, as columns (one entry per tensor)."""

    names: Names
    shapes: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_NDIM)]] = Field(
        max_length=MAX_BATCH
    )
    dtypes: list[Annotated[str, Field(max_length=40)]] = Field(
        max_length=MAX_BATCH, examples=[["float32", "bfloat16"]]
    )
    ttl: float | None = Field(
        None, gt=0, description="delete each tensor this many seconds after publish"
    )
    same: list[Annotated[int, Field(ge=-1)]] | None = Field(
        None,
        max_length=MAX_BATCH,
        description="per tensor: the position of an earlier tensor of the batch whose bytes it "
        "is (tied weights: stored once, under both names), or -1",
    )
    devices: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None,
        max_length=MAX_BATCH,
        description='per tensor: where to place it, as AllocRequest.device ("cpu", '
        '"cuda:<uuid>"); null: all in host memory.  A GPU tensor\'s whole handle comes '
        "back in the answer's others; /v1/many/put carries host tensors only",
    )


class ManyPublish(_Frozen):
    names: Names
    versions: list[Annotated[int, Field(ge=1)]] = Field(max_length=MAX_BATCH)


class Versions(_Answer):
    """The version each name now has, in the request's order."""

    names: list[str]
    versions: list[int]


class HandleColumns(_Answer):
    """Many handles as columns: entry ``i`` of each per-tensor list describes
    tensor ``i``.

    Shared-memory tensors lie in packs, each named once: a pack is a range
    of one segment, under one lease for a get (a ``put_many``'s small
    tensors share one block: a get of them takes one lease on it), as
    ``[segment, offset, nbytes, lease]``.  A tensor gives its pack, where its
    bytes start in it (``at``), and its layout: an index in ``layouts``, the
    batch's distinct ``[shape, dtype, nbytes]``, C-ordered (strides follow
    from the shape).  A tensor of another kind (CUDA) has pack -1, layout -1
    and its whole handle in ``others`` under its position."""

    names: list[str]
    versions: list[int]
    state: Literal["writing", "ready"]
    segments: list[str] = Field(description="the segments these tensors live in, each once")
    packs: list[tuple[int, int, int, int | None]] = Field(
        description="[segment (an index in segments), offset, nbytes, lease]: each range of a "
        "segment the tensors lie in, once, with the lease that keeps it (get; null: none)"
    )
    pack: list[int] = Field(description="per tensor: its index in packs, or -1")
    at: list[int] = Field(description="per tensor: where its bytes start in its pack")
    layouts: list[tuple[list[int], str, int]] = Field(
        description="[shape, dtype, nbytes]: each layout of the batch, once"
    )
    layout: list[int] = Field(description="per tensor: its index in layouts, or -1")
    others: dict[int, Handle] = Field(default_factory=dict)
    key: int | None = Field(
        None,
        description="the key of this answer's names, pack, at, layouts and layout: one pack's "
        "rows, which never change (null: none). A get_many that names it (?known=) is "
        "answered without them (empty lists) when its answer is that pack's rows again",
    )
    slots: list[int] | None = Field(
        None,
        description="per tensor, where the board of newest versions shows its name's newest "
        "(-1: nowhere), for a whole pack (Handle.slot); null: none",
    )


class TensorList(_Answer):
    items: list[TensorInfo]


class HeldName(_Answer, metaclass=_Described):
    """One name whose versions a session's leases hold (``Holder.names``)."""

    name: str = Field(description="the tensor's name")
    versions: list[int] = Field(description="the versions its leases hold, oldest first")
    leases: int = Field(description="leases on them")
    nbytes: int = Field(description="bytes of those versions")


class Holder(_Answer, metaclass=_Described):
    """One client session and what its leases hold, as ``Client.who()`` and
    ``tensordepot who`` show it: which process pins which versions.

    A frozen pydantic model: ``model_dump()`` gives a dict."""

    session: str = Field(description="the session id's first 8 characters, as the log shows it")
    pid: int | None = Field(description="its process (None over TCP)")
    label: str | None = Field(description="the label its client was made with")
    identity: str = Field(description="who opened it: uid:N on the socket, token:NAME over TCP")
    leases: int = Field(description="leases it holds (of the names shown)")
    nbytes: int = Field(description="bytes of the versions they hold, each version once")
    writing: int = Field(description="versions it allocated and has not published")
    exiting: bool = Field(description="its process said it exits: ended once it is gone")
    names: list[HeldName] = Field(description="what its leases hold, by name")


class HolderList(_Answer):
    items: list[Holder]


class FlightMeta(_Frozen):
    """What an Arrow Flight stream of a tensor carries in its schema metadata
    (key ``tensordepot``), as JSON.  The stream itself is one ``uint8``
    column whose record batches are consecutive chunks of the C-ordered bytes.

    ``origin``, ``origin_instance`` and ``origin_version`` name the version
    where it was first published: a replica of a replica keeps its origin, so
    brokers compare versions of one lineage and never version numbers of
    different brokers."""

    name: Name
    version: int = Field(ge=1, description="the version on the broker that sends it")
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_NDIM)
    dtype: str = Field(max_length=40)
    nbytes: int = Field(ge=0)
    origin: str = Field("", max_length=1000, description="Flight URL of the publishing broker")
    origin_instance: str = Field("", max_length=64, description="that broker's id for this run")
    origin_version: int = Field(0, ge=0, description="the version there")


class Health(_Answer):
    status: Literal["ok", "shutting_down"]
    version: str
