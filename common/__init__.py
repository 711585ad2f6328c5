"""tensordepot: zero-copy tensor exchange between processes on one host.

A broker (``tensordepot serve``) hands out shared memory; a ``Client`` puts
tensors into it and gets ``SharedTensor`` views of them, which torch, numpy,
jax and cupy import through DLPack without a copy::

    from tensordepot import Client
    with Client() as c:
        c.put("w", array)
        t = c.get("w", timeout=5.0)

``Client.get_many`` answers with a ``TensorMap`` (a dict-like mapping from
name to ``SharedTensor``), ``Client.list()`` with ``TensorInfo``,
``Client.stat()`` with ``Stat`` (one ``DeviceStat`` per GPU in use),
``Client.who()`` with a ``Holder`` per session (a ``HeldName`` per name it
holds).  Everything raised for bad
input or a broker in trouble is a ``DepotError``; each subclass below says
when it is raised.  ``InvalidRequest`` is also a ``ValueError``,
``InvalidType`` also a ``TypeError``, ``TensorNotFound`` also a
``KeyError``, and ``WaitTimedOut`` (a get's wait that ran out) both a
``TensorNotFound`` and a ``TimeoutError``.

``Client``, ``AsyncClient`` and ``SharedTensor`` load on first use (PEP 562),
so that ``tensordepot.shm`` and ``tensordepot.service``, which import this
package, never load the client.
"""

from __future__ import annotations

import typing

from ._errors import AuthError as AuthError
from ._errors import BrokerUnavailable as BrokerUnavailable
from ._errors import Cancelled as Cancelled
from ._errors import Conflict as Conflict
from ._errors import DepotError as DepotError
from ._errors import Forbidden as Forbidden
from ._errors import HeadersTooLarge as HeadersTooLarge
from ._errors import InvalidRequest as InvalidRequest
from ._errors import InvalidType as InvalidType
from ._errors import LimitExceeded as LimitExceeded
from ._errors import MethodNotAllowed as MethodNotAllowed
from ._errors import NoRoute as NoRoute
from ._errors import OutOfMemory as OutOfMemory
from ._errors import RequestTooLarge as RequestTooLarge
from ._errors import TensorBroken as TensorBroken
from ._errors import TensorNotFound as TensorNotFound
from ._errors import TensorReleased as TensorReleased
from ._errors import UnknownSession as UnknownSession
from ._errors import Unprocessable as Unprocessable
from ._errors import UntrustedBroker as UntrustedBroker
from ._errors import WaitTimedOut as WaitTimedOut
from ._lazy import lazy_names as _lazy_names
from ._version import __version__ as __version__
from ._wire import DeviceStat as DeviceStat
from ._wire import HeldName as HeldName
from ._wire import Holder as Holder
from ._wire import Stat as Stat
from ._wire import TensorInfo as TensorInfo

if typing.TYPE_CHECKING:
    from .client import AsyncClient as AsyncClient
    from .client import Client as Client
    from .client import SharedTensor as SharedTensor
    from .client import TensorMap as TensorMap

__all__ = [
    "AsyncClient",
    "AuthError",
    "BrokerUnavailable",
    "Cancelled",
    "Client",
    "Conflict",
    "DepotError",
    "DeviceStat",
    "Forbidden",
    "HeadersTooLarge",
    "HeldName",
    "Holder",
    "InvalidRequest",
    "InvalidType",
    "LimitExceeded",
    "MethodNotAllowed",
    "NoRoute",
    "OutOfMemory",
    "RequestTooLarge",
    "SharedTensor",
    "Stat",
    "TensorBroken",
    "TensorInfo",
    "TensorMap",
    "TensorNotFound",
    "TensorReleased",
    "UnknownSession",
    "Unprocessable",
    "UntrustedBroker",
    "WaitTimedOut",
    "__version__",
]

__getattr__, __dir__ = _lazy_names(
    __name__,
    dict.fromkeys(["AsyncClient", "Client", "SharedTensor", "TensorMap"], ".client"),
    globals(),
)
