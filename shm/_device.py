"""Devices by name: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"cuda:GPU-<uuid>"``.

Why UUIDs.  A CUDA ordinal is an index into the devices *this process* can
see, and ``CUDA_VISIBLE_DEVICES`` reorders and filters them per process:
with ``CUDA_VISIBLE_DEVICES=1,0`` the broker's ``cuda:0`` is a worker's
``cuda:1``.  A GPU's UUID is the same in every process, so everything that
crosses a process boundary (handles, ``TensorInfo.device``, alloc requests)
names GPUs by UUID, and each process maps UUIDs to its own ordinals with a
``DeviceMap`` built from what its CUDA driver enumerates.

``visible_devices`` models CUDA's rules for ``CUDA_VISIBLE_DEVICES`` (CUDA
C Programming Guide, "CUDA Environment Variables"), so the mapping can be
explained and checked without a GPU; on a GPU the driver applies the rules
and ``tests/e2e/test_cuda.py`` checks this model against it.

Nothing here imports CUDA.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

# nvidia-smi's spelling: GPU-8932f937-d72c-4106-c12f-20bd9faed9f6; MIG devices
# have MIG-<uuid>.  Hex is compared case-insensitively.
_UUID_BODY = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_UUID_RE = re.compile(rf"^(GPU|MIG)-({_UUID_BODY})$")
UUID_PATTERN = rf"^(GPU|MIG)-{_UUID_BODY}$"
ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"


class DeviceError(ValueError):
    """A device name that is malformed, or names a GPU this process cannot see."""


def format_uuid(raw: bytes, prefix: str = "GPU") -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` from the driver's 16 raw bytes."""
    if len(raw) != 16:
        raise ValueError(f"a device UUID is 16 bytes, not {len(raw)}")
    h = raw.hex()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def normalize_uuid(text: str) -> str:
    """The canonical spelling of a full device UUID (prefix kept, hex lowercase)."""
    m = _UUID_RE.match(text.strip())
    if m is None:
        raise DeviceError(
            f"{text!r} is not a device UUID; it looks like "
            "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6 (nvidia-smi -L lists them)"
        )
    return f"{m.group(1)}-{m.group(2).lower()}"


def uuid_key(uuid: str) -> str:
    """What identifies a device: the hex digits without the GPU-/MIG- prefix.

    The driver reports a MIG device's UUID as raw bytes, which we spell
    ``GPU-...``; nvidia-smi spells the same device ``MIG-...``.  Both name it."""
    return uuid.split("-", 1)[1].lower() if "-" in uuid else uuid.lower()


@dataclass(frozen=True)
class Device:
    """A parsed device name.  For CUDA, exactly one of ``ordinal`` and ``uuid``
    is set, or neither (plain ``"cuda"``: the current device)."""

    kind: str  # "cpu" | "cuda"
    ordinal: int | None = None
    uuid: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        if self.uuid is not None:
            return f"cuda:{self.uuid}"
        return "cuda" if self.ordinal is None else f"cuda:{self.ordinal}"


CPU = Device("cpu")


def parse_device(text: object) -> Device:
    """``"cpu"``, ``"cpu:0"``, ``"cuda"``, ``"cuda:N"``, ``"cuda:GPU-<uuid>"`` (or ``MIG-``).

    Anything with a ``type`` and ``index`` (a ``torch.device``) works too."""
    if not isinstance(text, str):
        kind, index = getattr(text, "type", None), getattr(text, "index", None)
        if kind in ("cpu", "cuda"):
            return parse_device(kind if index is None else f"{kind}:{index}")
        raise DeviceError(f"device {text!r}: use 'cpu', 'cuda', 'cuda:N' or 'cuda:GPU-<uuid>'")
    name = text.strip()
    low = name.lower()
    if low in ("cpu", "cpu:0"):
        return CPU
    if low == "cuda":
        return Device("cuda")
    if low.startswith("cuda:"):
        rest = name[5:]
        if rest.isascii() and rest.isdigit():  # no sign, no spaces, no non-ASCII digits
            return Device("cuda", ordinal=int(rest))
        if rest[:4].upper() in ("GPU-", "MIG-"):
            return Device("cuda", uuid=normalize_uuid(rest[:4].upper() + rest[4:]))
    raise DeviceError(
        f"device {text!r}: use 'cpu', 'cuda', 'cuda:N' (an ordinal in this process) or "
        f"'cuda:GPU-<uuid>' (nvidia-smi -L lists the UUIDs)"
    )


def visible_devices(env: str | None, physical: Sequence[str]) -> list[str]:
    """The UUIDs CUDA makes visible, in ordinal order, for ``CUDA_VISIBLE_DEVICES=env``.

    ``physical`` is every device the driver enumerates with the variable
    unset, in that order.  The rules:

    * unset (None): every device, in the driver's order;
    * a comma-separated list of entries, enumerated in the list's order;
      an entry is an index into ``physical``, or a ``GPU-``/``MIG-`` UUID or
      any prefix of one that names exactly one device;
    * at the first entry that is invalid (not a number or UUID, out of
      range, negative, ambiguous, or a repeat) the list ends: only the
      devices before it are visible.  So ``""`` hides every device and
      ``0,2,-1,1`` shows devices 0 and 2.
    """
    if env is None:
        return list(physical)
    out: list[str] = []
    for raw in env.split(","):
        entry = raw.strip()
        uuid = _match_entry(entry, physical)
        if uuid is None or uuid in out:
            break
        out.append(uuid)
    return out


def _match_entry(entry: str, physical: Sequence[str]) -> str | None:
    if entry.isascii() and entry.isdigit():
        i = int(entry)
        return physical[i] if i < len(physical) else None
    head = entry[:4].upper()
    if head not in ("GPU-", "MIG-") or len(entry) <= 4:
        return None
    want = entry[4:].lower()
    hits = [u for u in physical if u[:4].upper() == head and u[4:].lower().startswith(want)]
    return hits[0] if len(hits) == 1 else None


class DeviceMap:
    """This process's view of its GPUs: local ordinal <-> UUID."""

    def __init__(self, uuids: Sequence[str], env: str | None = None) -> None:
        self.uuids = [normalize_uuid(u) for u in uuids]
        self.env = env  # CUDA_VISIBLE_DEVICES as this process saw it, for messages
        self._by_key = {uuid_key(u): i for i, u in enumerate(self.uuids)}

    @classmethod
    def for_environment(cls, env: str | None, physical: Sequence[str]) -> DeviceMap:
        """The map a process with ``CUDA_VISIBLE_DEVICES=env`` gets (see ``visible_devices``)."""
        return cls(visible_devices(env, physical), env)

    def __len__(self) -> int:
        return len(self.uuids)

    def _where(self) -> str:
        env = self.env if self.env is not None else os.environ.get(ENV_VISIBLE)
        seen = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(self.uuids)) or "no GPU"
        shown = "unset" if env is None else repr(env)
        return f"this process sees {seen} (CUDA_VISIBLE_DEVICES {shown})"

    def ordinal(self, uuid: str) -> int:
        """The local ordinal of the GPU ``uuid``; DeviceError if it is not visible here."""
        i = self._by_key.get(uuid_key(uuid))
        if i is None:
            raise DeviceError(
                f"GPU {uuid} is not visible in this process: {self._where()}; make it visible "
                f"(CUDA_VISIBLE_DEVICES lists indices or UUIDs) or read the tensor elsewhere"
            )
        return i

    def uuid(self, ordinal: int) -> str:
        if not 0 <= ordinal < len(self.uuids):
            raise DeviceError(f"cuda:{ordinal} does not exist: {self._where()}")
        return self.uuids[ordinal]

    def resolve(self, device: Device, current: int = 0) -> tuple[int, str]:
        """(local ordinal, UUID) of a CUDA device; plain ``cuda`` is ``current``."""
        if not device.is_cuda:
            raise DeviceError(f"{device} is not a CUDA device")
        if device.uuid is not None:
            i = self.ordinal(device.uuid)
            return i, self.uuids[i]
        i = current if device.ordinal is None else device.ordinal
        return i, self.uuid(i)

    def __repr__(self) -> str:
        return f"DeviceMap({self.uuids!r})"
