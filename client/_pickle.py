"""Pickling, the torch.multiprocessing way: what a ``SharedTensor``, a
``Client`` and an ``AsyncClient`` become in a pickle.

* A SharedTensor pickles to what names it: its broker (the client's URL,
  token, timeout and trusted uids, and the broker's run: versions start
  again at 1 when a broker restarts), its name and its version.  Unpickled in
  another process it is got again there, through that process's own client
  for that broker (a ``Client`` of the same configuration, if one is open;
  else one made on first use and kept): zero copy, under a lease of its own.
  That exact version is got (``get(name, version=v)``), newest or not,
  while any lease keeps it, as the sender's does while it holds the tensor:
  the sender keeps it alive, as with torch.multiprocessing.  If nothing
  holds it any more and a newer one was published, or the name was deleted,
  or the broker restarted, unpickling raises ``TensorNotFound`` naming it.
  An ``empty()`` tensor not yet published is refused: nothing else may
  read it.
* A Client (or AsyncClient) pickles to its configuration and unpickles as a
  fresh one, which opens its own session on its first call.

So a Dataset that keeps a Client works under DataLoader workers started with
fork, spawn or forkserver, and a SharedTensor travels through a
``multiprocessing`` or ``torch.multiprocessing`` Queue.  A pickle carries the
client's token: send it to processes, never store it.  A torch tensor made
with ``torch.from_dlpack(shared)`` is torch's own: torch.multiprocessing
moves its bytes into memory of its own (a copy); send the SharedTensor
instead.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequest, TensorNotFound

if TYPE_CHECKING:
    from collections.abc import Callable

# The clients and tensors are Any here, and their modules register their
# makers (``MAKERS``): this module imports none of them, so none of them
# imports it in a cycle.
Config = tuple[str, "str | None", float, "str | None", tuple[int, ...]]
MAKERS: dict[str, Callable[..., Any]] = {}  # "sync", "async": (url, token=, ...) -> a client

_clients: dict[Config, Any] = {}  # the clients unpickling made, one per configuration
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # every Client of this process
_lock = threading.Lock()


def track(c: Any) -> None:
    """A new Client, which tensors unpickled here may be got through."""
    _open.add(c)


def config_of(core: Any) -> Config:
    """What a client is made from: URL, token, timeout, label and trusted uids."""
    return (core.url, core.token, core.timeout, core.label, tuple(sorted(core.trust)))


def reduce_tensor(t: Any) -> tuple[Any, tuple[Any, ...]]:
    """``SharedTensor.__reduce__``."""
    core = t._client()
    if t.writable or not t.published:
        raise InvalidRequest(
            f"tensor {t.name!r} v{t.version} is not published, so no other "
            f"process may read it: publish() it before sending it"
        )
    if core is None:
        raise InvalidRequest(
            f"tensor {t.name!r} v{t.version} cannot be sent: the client that "
            f"got it is gone, so its broker is unknown; send it while that "
            f"client lives"
        )
    return _rebuild_tensor, (config_of(core), t.name, t.version, t._instance)


def reduce_client(core: Any, kind: str) -> tuple[Any, tuple[Any, ...]]:
    """``Client.__reduce__`` and ``AsyncClient.__reduce__`` (``kind``)."""
    return _rebuild_client, (kind, config_of(core))


def _rebuild_client(kind: str, config: Config) -> Any:
    url, token, timeout, label, trust = config
    return MAKERS[kind](url, token=token, timeout=timeout, label=label, trust_uid=trust)


def client_for(config: Config) -> Any:
    """This process's client for ``config``: an open Client of it, else one
    made (unopened) on first use and kept."""
    for c in list(_open):
        core = c._core
        if not (core.closed or core.closing) and config_of(core) == config:
            return c
    with _lock:
        c = _clients.get(config)
        if c is None or c._core.closed:
            c = _clients[config] = _rebuild_client("sync", config)
        return c


def _rebuild_tensor(config: Config, name: str, version: int, instance: str = "") -> Any:
    c = client_for(config)
    try:
        t = c.get(name, version=version)
    except TensorNotFound as exc:
        raise TensorNotFound(
            f"the tensor sent, {name!r} v{version}, is gone from the broker "
            f"({exc}); the sender must hold it (keep the SharedTensor or a "
            f"view of it) until the receiver has it"
        ) from None
    if instance and t._instance != instance:  # versions start again at 1 in a new broker
        t.release()
        raise TensorNotFound(
            f"the tensor sent, {name!r} v{version}, is gone: the broker that "
            f"served it has restarted since, and its {name!r} is another "
            f"tensor; send it again from the new broker"
        )
    return t
