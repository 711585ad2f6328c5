"""Whom the client talks to: the broker behind a unix socket must run as a
trusted uid.

Trusted are this process's own effective uid, root (which can read any
process's memory anyway, so trusting it exposes nothing new), and the uids
given as ``Client(trust_uid=...)`` or ``$TENSORDEPOT_TRUST_UID`` (comma
separated uids or user names).  The same set decides which owners of a
segment the client will map (``shm._posix.check_segment``).

The check asks the kernel who holds the listening end (SO_PEERCRED on the
connected socket), not who owns the socket file: that is the process that
will receive our requests, and it cannot be swapped between a check and the
connect.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable

from .._defaults import ENV_TRUST_UID
from .._errors import InvalidRequest, UntrustedBroker
from .._ids import describe_uid, user_id


def trusted_uids(extra: int | str | Iterable[int | str] | None = None) -> frozenset[int]:
    """This process's uid, root, ``extra`` and ``$TENSORDEPOT_TRUST_UID``."""
    if extra is None:
        extra = ()
    elif isinstance(extra, (int, str)):
        extra = (extra,)
    env = [p.strip() for p in os.environ.get(ENV_TRUST_UID, "").split(",") if p.strip()]
    try:
        return frozenset({os.geteuid(), 0, *(user_id(str(u)) for u in (*extra, *env))})
    except ValueError as exc:
        raise InvalidRequest(f"trust_uid / ${ENV_TRUST_UID}: {exc}") from None


_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix
    socket, as the kernel reports them (SO_PEERCRED; pid 0: in a pid
    namespace this process cannot see)."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def check_broker_socket(
    sock: socket.socket, path: str, trusted: frozenset[int] | None = None
) -> None:
    """Raise UntrustedBroker (closing ``sock``) unless the process listening on
    the connected unix socket ``sock`` runs as a trusted uid (default: ``trusted_uids()``)."""
    if trusted is None:
        trusted = trusted_uids()
    _, uid, _ = peer_cred(sock)
    if uid in trusted:
        return
    sock.close()
    names = ", ".join(describe_uid(u) for u in sorted(trusted))
    raise UntrustedBroker(
        f"the broker socket {path} is served by uid {describe_uid(uid)}, which this client does "
        f"not trust (trusted: {names}); another user may have taken over its directory "
        f"(ls -ld {os.path.dirname(path)}). If that user really runs your broker, pass "
        f"Client(trust_uid={uid}) or set ${ENV_TRUST_UID}={uid}"
    )


def connected(sock: socket.socket, addr: object, trust: frozenset[int] | None) -> socket.socket:
    """A socket just connected to the broker, made ready for requests, for
    both transports: on a unix socket, who listens there is checked
    (``UntrustedBroker``); over TCP, small requests go out at once
    (TCP_NODELAY)."""
    if sock.family == socket.AF_UNIX:
        check_broker_socket(sock, str(addr), trust)
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
