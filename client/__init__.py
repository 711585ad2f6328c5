"""What workers import: Client, SharedTensor."""

from ._client import Client as Client
from ._tensor import SharedTensor as SharedTensor

__all__ = ["Client", "SharedTensor"]
