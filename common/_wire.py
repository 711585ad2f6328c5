"""What crosses HTTP: frozen pydantic models imported by both the broker and
the client, so nothing is defined twice.  Handles describe memory and never
carry the tensor's bytes (except ``PutRequest.data``, the inline fast path
for small tensors)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# A tensor name: printable ASCII without spaces, up to 512 characters.
# Dots and slashes are fine ("model.layers.0.weight", "run/1/w").
NAME_PATTERN = r"^[\x21-\x7e]{1,512}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, examples=["model.layers.0.weight"])]
MAX_NDIM = 32
MAX_BATCH = 10_000
INLINE_MAX = 256 * 1024  # bytes; larger tensors go through alloc + publish


class _Frozen(BaseModel):
    """What a client sends: unknown fields are refused (422), never ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class _Answer(BaseModel):
    """What the broker sends: a client ignores fields a newer broker added."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class ErrorDetail(_Answer):
    code: str = Field(examples=["not_found"])
    message: str = Field(examples=["tensor 'w' not found (known: a, b); did the producer publish it?"])


class ErrorBody(_Answer):
    error: ErrorDetail


class SessionOpen(_Frozen):
    pid: int = Field(ge=1, description="the client's pid, as it sees itself")
    start_time: int | None = Field(None, ge=0, description="field 22 of /proc/<pid>/stat")
    label: str | None = Field(None, max_length=200)


class SessionInfo(_Answer):
    session: str
    pid: int | None
    tracked: bool = Field(description="liveness checked through the pid (SO_PEERCRED); else by heartbeat")
    heartbeat_interval: float | None = Field(description="send heartbeats this often (s), or never")


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
    ttl: float | None = Field(None, gt=0, description="delete the tensor this many seconds after publish")
    hold: bool = Field(False, description="also take a lease for the writer's own views, which "
                                          "keeps the memory theirs after publish, delete or supersede")


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


class PublishRequest(_Frozen):
    name: Name
    version: int = Field(ge=1)


class LinkRequest(_Frozen):
    name: Name
    lease: int = Field(description="a lease this session holds on the source version")
    ttl: float | None = Field(None, gt=0)


class ReleaseRequest(_Frozen):
    leases: list[int] = Field(default_factory=list, max_length=MAX_BATCH * 10)
    requests: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=MAX_BATCH,
        description="request ids whose answers were never read: their leases are released "
                    "and their waits cancelled")


class TensorInfo(_Answer):
    name: str
    version: int
    shape: list[int]
    dtype: str
    nbytes: int
    device: str
    state: Literal["writing", "ready"]
    readers: int = Field(description="live leases on this name's versions")
    expires_in: float | None = None
    origin: str | None = Field(None, description="for a replica pulled from a peer: the Flight URL "
                               "of the broker where the tensor was published")
    origin_version: int | None = Field(None, description="for a replica: its version at the origin")


class Stat(_Answer):
    """The broker's accounting, as ``Client.stat()`` and ``tensordepot stat`` show it."""

    bytes_in_use: int = Field(description="bytes held by tensor versions, pending deletes included")
    bytes_reserved: int = Field(description="bytes of shared memory the broker holds, warm free space included")
    bytes_retired: int = Field(0, description="bytes the broker will never reuse because a process it "
                                              "cannot vouch for may still map them; freed with their segment")
    retired_total: int = Field(0, description="bytes retired since the broker started")
    max_memory: int
    tensors: int
    versions: int
    leases: int
    sessions: int
    segments: int
    waiting: int = Field(0, description="gets parked now, waiting for a publish")


class BatchAlloc(_Frozen):
    items: list[AllocRequest] = Field(max_length=MAX_BATCH)


class BatchPublish(_Frozen):
    items: list[PublishRequest] = Field(max_length=MAX_BATCH)


class BatchGet(_Frozen):
    names: list[Name] = Field(max_length=MAX_BATCH)
    timeout: float | None = Field(0.0, ge=0, allow_inf_nan=False,
                                  description="one deadline for the whole batch, in seconds; null: forever")


class HandleList(_Answer):
    items: list[Handle]


class TensorList(_Answer):
    items: list[TensorInfo]


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
