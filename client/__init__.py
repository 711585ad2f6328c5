"""What workers import: Client, AsyncClient, SharedTensor."""

from ._async import AsyncClient as AsyncClient
from ._client import Client as Client
from ._tensor import SharedTensor as SharedTensor

__all__ = ["AsyncClient", "Client", "SharedTensor"]
