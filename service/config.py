"""Broker settings: one field per setting, read from ``TENSORDEPOT_<NAME>``.

``tensordepot serve`` makes its flags from these fields (``--<name>``, the
field's description as its help; flags win over the environment), so a
setting is described once."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .._defaults import ENV_PREFIX, default_socket_path, parse_size
from .._ids import group_id

if TYPE_CHECKING:  # the broker loads only where limits() is called: the CLI reads Settings
    from ._registry._quotas import Limits


class ListenError(RuntimeError):
    """A listener (``--listen``, ``--flight``) cannot be set up; the message
    says what to do."""


def _size(text: str) -> str:
    parse_size(text)
    return text


def _size_or_auto(text: str) -> str:
    return text if text == "auto" else _size(text)


# Sizes stay as given (messages quote them); a bad one fails when Settings is built.
Size = Annotated[str, AfterValidator(_size)]
SizeOrAuto = Annotated[str, AfterValidator(_size_or_auto)]


def shm_capacity() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_frsize * st.f_blocks


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # Each description is the help of its flag: ``tensordepot serve`` generates
    # --<name> (and $TENSORDEPOT_<NAME>) from these fields.
    listen: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="where to listen: unix:///path.sock or "
        "http://host:port; repeatable; none: the default socket, where clients look when "
        "$TENSORDEPOT_URL is unset",
    )
    max_memory: SizeOrAuto = Field(
        "auto",
        description="shared memory the broker may hold, more "
        "than 0, e.g. 8GiB; auto: half of /dev/shm",
    )
    segment_size: Size = Field("256MiB", description="size of each pooled shared-memory segment")
    warm_memory: SizeOrAuto = Field(
        "auto",
        description="free memory kept warm for reuse; auto: "
        "2GiB or --max-memory, whichever is less",
    )
    prealloc: Size = Field("256MiB", description="pool memory created and pre-faulted at start")
    cuda_memory: SizeOrAuto = Field(
        "auto",
        description="device memory the broker may hold on each GPU, e.g. 16GiB; auto: "
        "half of each GPU's memory; nothing is allocated on a GPU until a tensor is placed there",
    )
    cuda_segment_size: Size = Field("256MiB", description="size of each pooled CUDA block")
    shm_prefix: str = Field(
        "", description="segment name prefix; empty: derived from the first --listen"
    )
    shm_group: str = Field(
        "",
        description="group of the socket (0660) and the segments (0640: "
        "the group maps them read-only; 0660 with --allow-uid/--allow-gid); "
        "empty: owner only (0600)",
    )
    token: str = Field(
        "",
        description="an admin bearer token (visible in the process list: "
        "prefer --token-file or TENSORDEPOT_TOKEN)",
    )
    token_file: str = Field(
        "",
        description="bearer tokens, one per line: '<token> <scope> "
        "[prefix=<p>] [name=<n>]', scope read, write or admin; mode 0600",
    )
    no_lane: bool = Field(
        False,
        description="hand no client a shared-memory lane: every request goes over HTTP "
        "(docs/plan-lane.md)",
    )
    insecure_no_auth: bool = Field(
        False,
        description="let TCP listeners run without a token "
        "(anyone who reaches them may do anything)",
    )
    allow_uid: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="also admit this user (uid or name) on the unix socket, "
        "as admin; repeatable; needs --shm-group, a group it is in",
    )
    allow_gid: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="also admit members of this group (gid or name) on the "
        "unix socket, as admin; the socket and segments become the group's, mode 0660; repeatable",
    )
    reap_interval: float = Field(0.5, gt=0, description="seconds between liveness checks")
    session_ttl: float = Field(
        15.0,
        gt=0,
        description="heartbeat timeout, in seconds, for sessions whose pid cannot be checked",
    )
    lapse_grace: float = Field(
        60.0,
        ge=0,
        description="seconds after a heartbeat session "
        "lapses (--session-ttl unheard) before the memory it may still "
        "map is reused; its process counts as gone then (0: never, the "
        "memory stays retired until its segment drains)",
    )
    alloc_ttl: float = Field(
        600.0,
        ge=0,
        description="seconds an allocation may stay unpublished before it is reclaimed (0: never)",
    )
    max_sessions: int = Field(16384, gt=0, description="sessions the broker holds at most")
    max_sessions_per_peer: int = Field(
        256, gt=0, description="sessions one process, or one token over TCP, may hold"
    )
    max_leases_per_session: int = Field(
        65536,
        gt=0,
        description="leases one session may hold (each got tensor it still reads holds one)",
    )
    max_memory_per_session: Size = Field(
        "0", description="bytes one session may hold, e.g. 1GiB (0: no limit)"
    )
    max_memory_per_token: Size = Field(
        "0", description="bytes one identity (a uid, or a token) may hold, e.g. 4GiB (0: no limit)"
    )
    max_connections: int = Field(
        4096, gt=0, description="open connections; beyond it the longest-idle one is closed"
    )
    log_level: str = Field("info", description="debug, info, warning or error")

    # -- across hosts: Arrow Flight (service/_hosts/_flight.py, service/_hosts/_peers.py) -----
    flight: str = Field(
        "", description="serve tensors to other hosts: grpc://HOST:PORT or grpc+tls://HOST:PORT"
    )
    flight_tls_cert: str = Field("", description="PEM certificate file for a grpc+tls:// --flight")
    flight_tls_key: str = Field("", description="PEM private key file for a grpc+tls:// --flight")
    peer: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="pull tensors missing here from this broker's --flight URL; repeatable",
    )
    peer_refresh: float = Field(
        1.0,
        ge=0,
        description="seconds a replica is served before its "
        "peers are asked for a newer version; 0: on every get",
    )
    peer_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds to wait for a peer's answer, or for the next chunk of a transfer",
    )
    peer_token: str = Field(
        "",
        description="bearer token sent to peers; empty: --token (prefer "
        "TENSORDEPOT_PEER_TOKEN: argv is visible to other users)",
    )
    peer_tls_ca: str = Field(
        "", description="PEM CA bundle that signs the grpc+tls:// peers' certificates"
    )

    @field_validator("peer", mode="before")
    @classmethod
    def _split_peers(cls, v: object) -> object:
        return [p for p in (s.strip() for s in v.split(",")) if p] if isinstance(v, str) else v

    @field_validator("listen", "allow_uid", "allow_gid", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        if isinstance(v, str):
            return [p for p in (s.strip() for s in v.split(",")) if p]
        if isinstance(v, (list, tuple)):
            return [str(p) for p in v]
        return v

    def listen_urls(self) -> list[str]:
        return self.listen or ["unix://" + default_socket_path()]

    def max_memory_bytes(self) -> int:
        if self.max_memory == "auto":
            return shm_capacity() // 2
        return parse_size(self.max_memory)

    def warm_memory_bytes(self) -> int:
        if self.warm_memory == "auto":
            return min(2 << 30, self.max_memory_bytes())
        return parse_size(self.warm_memory)

    def limits(self) -> Limits:
        from ._registry._quotas import Limits

        return Limits(
            session_ttl=self.session_ttl,
            alloc_ttl=self.alloc_ttl,
            lapse_grace=self.lapse_grace,
            max_sessions=self.max_sessions,
            max_sessions_per_peer=self.max_sessions_per_peer,
            max_leases_per_session=self.max_leases_per_session,
            max_memory_per_session=parse_size(self.max_memory_per_session),
            max_memory_per_identity=parse_size(self.max_memory_per_token),
        )

    def cuda_memory_bytes(self) -> int | None:
        """The per-GPU limit; None (auto) is half of each GPU's memory, known once it is used."""
        return None if self.cuda_memory == "auto" else parse_size(self.cuda_memory)

    def prefix(self) -> str:
        if self.shm_prefix:
            return self.shm_prefix
        digest = hashlib.sha256(self.listen_urls()[0].encode()).hexdigest()[:10]
        return f"tensordepot-{digest}-"

    def gid(self) -> int | None:
        """The ``--shm-group`` as a gid (None: not set); ValueError for an unknown group."""
        return group_id(self.shm_group) if self.shm_group else None


@lru_cache
def get_settings() -> Settings:
    """The settings of the environment, read once (``create_app`` uses them
    when given none)."""
    return Settings()
