"""Defaults shared by the broker and the client, so both agree without talking."""

from __future__ import annotations

import os

# Every variable of ours starts with it (--max-memory is TENSORDEPOT_MAX_MEMORY).
ENV_PREFIX = "TENSORDEPOT_"
ENV_URL = ENV_PREFIX + "URL"
ENV_TOKEN = ENV_PREFIX + "TOKEN"
# uids (or names) whose broker and segments a client trusts
ENV_TRUST_UID = ENV_PREFIX + "TRUST_UID"
SYSTEM_SOCKET = "/run/tensordepot/broker.sock"


def default_socket_path() -> str:
    """Where the broker listens when given no --listen.

    ``/run/tensordepot/broker.sock`` for root; otherwise
    ``$XDG_RUNTIME_DIR/tensordepot/broker.sock``, or
    ``/tmp/tensordepot-<uid>/broker.sock`` when that variable is unset.
    """
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "tensordepot", "broker.sock")
    return f"/tmp/tensordepot-{os.geteuid()}/broker.sock"


def default_url() -> str:
    """``$TENSORDEPOT_URL``, else the default socket as a ``unix://`` URL."""
    return os.environ.get(ENV_URL) or "unix://" + default_socket_path()


def parse_size(text: str | int) -> int:
    """``"8GiB"`` -> 8589934592, through pydantic's ``ByteSize``: decimal units
    (k, kb, M, MB, ...), binary ones (KiB, MiB, GiB, ...), case-insensitive,
    fractions (``"1.5GiB"``); plain numbers are bytes.  ValueError otherwise."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 8GiB, 1000000)") from None
