"""What workers import: Client, AsyncClient, SharedTensor (and TensorMap, what get_many returns)."""

from ._async import AsyncClient as AsyncClient
from ._client import Client as Client
from ._tensor import SharedTensor as SharedTensor
from ._tensormap import TensorMap as TensorMap

__all__ = ["AsyncClient", "Client", "SharedTensor", "TensorMap"]
