"""The broker: FastAPI app, registry of names, versions, leases and sessions."""

from ._broker import Broker as Broker
from .app import create_app as create_app
from .config import Settings as Settings

__all__ = ["Broker", "Settings", "create_app"]
