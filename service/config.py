"""Broker settings: every flag of ``tensordepot serve`` is also a
``TENSORDEPOT_*`` environment variable (flags win)."""

from __future__ import annotations

import hashlib
import os
import re
from functools import lru_cache
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .._defaults import default_socket_path
from .._ids import group_id
from ._broker import Limits

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"8GiB"`` -> 8589934592.  Plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 8GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def shm_capacity() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_frsize * st.f_blocks


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENSORDEPOT_", extra="ignore")

    listen: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="unix:///path.sock or http://host:port; repeatable")
    max_memory: str = Field("auto", description="shared memory the broker may hold; auto: half of "
                                                "/dev/shm")
    segment_size: str = Field("256MiB", description="size of each pooled segment")
    warm_memory: str = Field("auto", description="free memory kept warm for reuse; auto: 2GiB or "
                                                 "max-memory")
    prealloc: str = Field("256MiB", description="pool memory to create and pre-fault at start")
    cuda_memory: str = Field("auto", description="device memory the broker may hold on each GPU; "
                             "auto: half of the GPU's memory")
    cuda_segment_size: str = Field("256MiB", description="size of each pooled CUDA block")
    shm_prefix: str = Field("", description="segment name prefix; default derived from the first "
                                            "--listen")
    shm_group: str = Field("", description="group of the socket (0660) and segments (0640, or "
                                            "0660 with --allow-uid/--allow-gid); default none "
                                            "(0600)")
    token: str = Field("",
                       description="an admin bearer token (prefer --token-file: argv is public)")
    token_file: str = Field("", description="file of bearer tokens with scopes, one per line")
    insecure_no_auth: bool = Field(False, description="let TCP listeners run without any token")
    allow_uid: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="unix-socket peers (uid or name) admitted, as admin")
    allow_gid: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="unix-socket peers in this group (gid or name) admitted")
    reap_interval: float = Field(0.5, gt=0, description="seconds between liveness checks")
    session_ttl: float = Field(15.0, gt=0, description="heartbeat timeout for sessions whose pid "
                                                       "cannot be checked")
    alloc_ttl: float = Field(600.0, ge=0, description="unpublished allocations expire after this "
                                                      "many seconds (0: never)")
    max_sessions: int = Field(16384, gt=0, description="sessions the broker holds at most")
    max_sessions_per_peer: int = Field(256, gt=0, description="sessions one process (or one token "
                                                              "over TCP) may hold")
    max_memory_per_session: str = Field("0", description="bytes one session may hold (0: no limit)")
    max_memory_per_token: str = Field("0", description="bytes one identity (uid or token) may hold "
                                                       "(0: no limit)")
    max_connections: int = Field(4096, gt=0, description="open connections; beyond it the "
                                                         "longest-idle is closed")
    log_level: str = Field("info")

    # -- across hosts: Arrow Flight (service/_flight.py, service/_peers.py) ---------------
    flight: str = Field("", description="serve tensors to other hosts: grpc://HOST:PORT or "
                                        "grpc+tls://HOST:PORT")
    flight_tls_cert: str = Field("", description="PEM certificate file for a grpc+tls:// --flight")
    flight_tls_key: str = Field("", description="PEM private key file for a grpc+tls:// --flight")
    peer: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="pull tensors missing here from this broker's --flight URL; repeatable")
    peer_refresh: float = Field(1.0, ge=0, description="seconds a replica is served before its "
                                                       "peers are asked for a newer version; 0: "
                                                       "every get")
    peer_timeout: float = Field(5.0, gt=0, description="seconds to wait for a peer's answer, or "
                                                       "for the next chunk of a transfer")
    peer_token: str = Field("", description="bearer token sent to peers; default: --token")
    peer_tls_ca: str = Field("", description="PEM CA bundle that signs the grpc+tls:// peers' "
                                             "certificates")

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
        return Limits(session_ttl=self.session_ttl, alloc_ttl=self.alloc_ttl,
                      max_sessions=self.max_sessions,
                      max_sessions_per_peer=self.max_sessions_per_peer,
                      max_memory_per_session=parse_size(self.max_memory_per_session),
                      max_memory_per_identity=parse_size(self.max_memory_per_token))
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
    """The settings dependency; tests override it with app.dependency_overrides."""
    return Settings()
