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

    listen: Annotated[list[str], NoDecode] = Field(default_factory=list, description="unix:///path.sock or http://host:port; repeatable")
    max_memory: str = Field("auto", description="shared memory the broker may hold; auto: half of /dev/shm")
    segment_size: str = Field("256MiB", description="size of each pooled segment")
    warm_memory: str = Field("auto", description="free memory kept warm for reuse; auto: 2GiB or max-memory")
    prealloc: str = Field("256MiB", description="pool memory to create and pre-fault at start")
    cuda_memory: str = Field("auto", description="device memory the broker may hold on each GPU; "
                             "auto: half of the GPU's memory")
    cuda_segment_size: str = Field("256MiB", description="size of each pooled CUDA block")
    shm_prefix: str = Field("", description="segment name prefix; default derived from the first --listen")
    shm_group: str = Field("", description="group that may map segments (mode 0640/0660); default none (0600)")
    token: str = Field("", description="bearer token required on TCP listeners")
    reap_interval: float = Field(0.5, gt=0, description="seconds between liveness checks")
    session_ttl: float = Field(15.0, gt=0, description="heartbeat timeout for sessions whose pid cannot be checked")
    log_level: str = Field("info")

    @field_validator("listen", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        if isinstance(v, str):
            return [p for p in (s.strip() for s in v.split(",")) if p]
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

    def cuda_memory_bytes(self) -> int | None:
        """The per-GPU limit; None (auto) is half of each GPU's memory, known once it is used."""
        return None if self.cuda_memory == "auto" else parse_size(self.cuda_memory)

    def prefix(self) -> str:
        if self.shm_prefix:
            return self.shm_prefix
        digest = hashlib.sha256(self.listen_urls()[0].encode()).hexdigest()[:10]
        return f"tensordepot-{digest}-"

    def gid(self) -> int | None:
        if not self.shm_group:
            return None
        import grp

        return grp.getgrnam(self.shm_group).gr_gid if not self.shm_group.isdigit() else int(self.shm_group)


@lru_cache
def get_settings() -> Settings:
    """The settings dependency; tests override it with app.dependency_overrides."""
    return Settings()
