"""The small interface every memory kind implements.

A *segment* is a named region owned by the broker; a *mapping* is one
process's view of it.  Handles on the wire carry (kind, segment, offset,
nbytes) and nothing more, so a new memory kind (CUDA IPC blocks) only has to
provide these two protocols.
"""

from __future__ import annotations

from typing import Protocol


class Segment(Protocol):
    """A broker-owned region.  ``unlink()`` is called once, by the broker."""

    kind: str
    name: str
    size: int

    def unlink(self) -> None: ...


class Mapping(Protocol):
    """One process's view of a segment.  Closing is implicit: the mapping is
    released when the last object that references it (a tensor view) dies."""

    kind: str
    name: str
    size: int
    address: int
    writable: bool
