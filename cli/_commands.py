"""The client commands: ``ls``, ``stat``, ``who``, ``rm``, ``wait``, ``load``,
``save`` and ``push``.

They import only the client (numpy, pydantic), never the broker's FastAPI
and uvicorn, so ``tensordepot ls`` costs little more than ``import
tensordepot``.  Results go to stdout, problems to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._defaults import ENV_TOKEN, default_url

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_size(n: int) -> str:
    """A byte count for people: ``1610612736`` -> ``"1.5 GiB"``, ``512`` -> ``"512 B"``."""
    if n < 1024:
        return f"{n} B"
    value, k = n / 1024, 0
    while round(value, 1) >= 1024 and k < len(_UNITS) - 1:  # 1023.96 KiB shows as 1 MiB
        value, k = value / 1024, k + 1
    return f"{value:.1f}".removesuffix(".0") + " " + _UNITS[k]


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def connect(args: argparse.Namespace) -> Any:
    """The ``Client`` of ``--url`` and ``--token``."""
    from ..client import Client

    if args.token is not None:
        print(
            "tensordepot: --token is visible to every local user in the process list; "
            "prefer $TENSORDEPOT_TOKEN",
            file=sys.stderr,
        )
    return Client(args.url, token=args.token)


def ls(args: argparse.Namespace) -> int:
    """``tensordepot ls``: a table of the tensors, or JSON."""
    with connect(args) as c:
        items = c.list(prefix=args.prefix)
    if args.json:
        _print_json([i.model_dump() for i in items])
        return 0
    rows = [
        (
            i.name,
            str(i.version),
            i.dtype,
            str(tuple(i.shape)),
            str(i.nbytes) if args.bytes else format_size(i.nbytes),
            str(i.readers),
            i.state,
        )
        for i in items
    ]
    head = ("NAME", "VER", "DTYPE", "SHAPE", "BYTES" if args.bytes else "SIZE", "READERS", "STATE")
    _table(head, rows, right={1, 4, 5})
    return 0


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]], right: set[int]) -> None:
    """Print rows under a head, in columns; the columns ``right`` (numbers)
    line up on the right."""
    widths = [max([len(head[k])] + [len(r[k]) for r in rows]) for k in range(len(head))]
    for row in [head, *rows]:
        cells = [
            cell.rjust(w) if k in right else cell.ljust(w)
            for k, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def stat(args: argparse.Namespace) -> int:
    """``tensordepot stat``: memory and lifetime accounting."""
    with connect(args) as c:
        st = c.stat().model_dump()
    if args.json:
        _print_json(st)
        return 0
    devices = st.pop("devices", [])
    for key, value in st.items():
        sized = "bytes" in key or "memory" in key
        print(f"{key:15} {format_size(value) if sized and not args.bytes else value}")
    for dev in devices:
        size = (lambda n: str(n)) if args.bytes else format_size
        ctx = "unknown" if dev["context_bytes"] is None else size(dev["context_bytes"])
        print(
            f"{dev['device']}: in use {size(dev['bytes_in_use'])}, reserved "
            f"{size(dev['bytes_reserved'])}, pending {size(dev['bytes_pending'])}, shared "
            f"{size(dev['bytes_shared'])}, max {size(dev['max_memory'])}, context {ctx}"
        )
    return 0


def who(args: argparse.Namespace) -> int:
    """``tensordepot who``: which process holds leases on which names."""
    with connect(args) as c:
        me = c._core.sid  # this command's own session holds nothing: left out
        holders = [h for h in c.who() if not me.startswith(h.session)]
    if args.json:
        _print_json([h.model_dump() for h in holders])
        return 0
    size = (lambda n: str(n)) if args.bytes else format_size
    rows = []
    for h in holders:
        held = ", ".join(f"{n.name} v{','.join(map(str, n.versions))}" for n in h.names[:8])
        held += f", ... ({len(h.names)} names)" if len(h.names) > 8 else ""
        rows.append(
            (
                str(h.pid or "-"),
                h.session,
                h.label or "-",
                h.identity,
                str(h.leases),
                size(h.nbytes),
                held + (" (exiting)" if h.exiting else ""),
            )
        )
    head = (
        "PID",
        "SESSION",
        "LABEL",
        "IDENTITY",
        "LEASES",
        "BYTES" if args.bytes else "SIZE",
        "HOLDS",
    )
    _table(head, rows, right={0, 4, 5})
    return 0


def rm(args: argparse.Namespace) -> int:
    """``tensordepot rm``: delete each name, and with ``--prefix`` every name
    that starts with it (one request); 1 if any name is missing or refused."""
    from .._errors import InvalidRequest, TensorNotFound

    deleted: list[str] = []
    missing: list[str] = []
    refused: dict[str, str] = {}
    if not args.names and args.prefix is None:
        print("tensordepot rm: name the tensors to delete, or pass --prefix", file=sys.stderr)
        return 2
    with connect(args) as c:
        if args.prefix is not None:
            try:
                deleted += c.delete(prefix=args.prefix)
            except InvalidRequest as exc:
                refused[args.prefix] = str(exc)
                print(
                    f"tensordepot rm: cannot remove --prefix {args.prefix!r}: {exc}",
                    file=sys.stderr,
                )
            else:
                if not deleted:
                    print(
                        f"tensordepot rm: no tensor name starts with {args.prefix!r}",
                        file=sys.stderr,
                    )
        rest = list(args.names)
        if len(rest) > 1:
            try:
                deleted += c.delete_many(rest)  # one request when every name is there
                rest = []
            except (TensorNotFound, InvalidRequest):
                pass  # name by name, below
        for name in rest:  # one bad name does not stop the others
            try:
                c.delete(name)
            except TensorNotFound:
                missing.append(name)
                print(f"tensordepot rm: cannot remove {name!r}: no such tensor", file=sys.stderr)
            except InvalidRequest as exc:
                refused[name] = str(exc)
                print(f"tensordepot rm: cannot remove {name!r}: {exc}", file=sys.stderr)
            else:
                deleted.append(name)
    if args.json:
        _print_json({"deleted": deleted, "missing": missing, "refused": refused})
    return 1 if missing or refused else 0


def wait(args: argparse.Namespace) -> int:
    """``tensordepot wait``: 0 once the broker answers, 1 after ``--timeout``."""
    from .._errors import BrokerUnavailable
    from ..client._transport import Transport

    url = args.url or default_url()
    start = time.monotonic()
    deadline = start + args.timeout
    transport = Transport(url, token=args.token or os.environ.get(ENV_TOKEN))
    why = "nothing answered"
    try:
        while True:
            try:
                # /healthz needs no session and no token; it says "ok" once the
                # broker serves, and "shutting_down" while an old one exits.
                health = transport.request(
                    "GET", "/healthz", timeout=max(deadline - time.monotonic(), 0.05)
                )
            except BrokerUnavailable as exc:
                why = str(exc)
            else:
                if isinstance(health, dict) and health.get("status") == "ok":
                    waited = time.monotonic() - start
                    if args.json:
                        _print_json(
                            {
                                "url": url,
                                "status": "ok",
                                "version": health.get("version"),
                                "waited": round(waited, 3),
                            }
                        )
                    else:
                        print(
                            f"broker ready at {url} (tensordepot {health.get('version')}, "
                            f"waited {waited:.2f} s)"
                        )
                    return 0
                why = f"the broker answered {health!r}"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
    finally:
        transport.close()
    print(
        f"tensordepot wait: no broker answered at {url} within {args.timeout:g} s ({why}); "
        f"start one with `tensordepot serve`, or point --url (or $TENSORDEPOT_URL) at its socket",
        file=sys.stderr,
    )
    return 1


def _progress(what: str) -> Any:
    """A progress report on stderr, for files of more than a few seconds' copy."""

    def report(done: int, total: int) -> None:
        if total >= 256 << 20:
            print(
                f"tensordepot {what}: {format_size(done)} of {format_size(total)} "
                f"({100 * done // max(total, 1)}%)",
                file=sys.stderr,
            )

    return report


def load(args: argparse.Namespace) -> int:
    """``tensordepot load FILE... --prefix P``: every tensor of safetensors
    files (a file, several, a folder of shards, an index), in one batch."""
    what = args.files[0] if len(args.files) == 1 else args.files
    with connect(args) as c:
        versions = c.load_file(what, args.prefix, progress=_progress("load"))
    if args.json:
        _print_json(versions)
    else:
        meta = args.prefix + "__metadata__" in versions
        where = args.files[0] if len(args.files) == 1 else f"{len(args.files)} files"
        print(f"{len(versions) - meta} tensors{' and its metadata' * meta} from {where}")
    return 0


def save(args: argparse.Namespace) -> int:
    """``tensordepot save PREFIX PATH``: the tensors under a prefix, to a
    file, or to shards and an index in the folder PATH (``--max-shard-size``)."""
    with connect(args) as c:
        written = c.save_file(
            args.prefix, args.file, progress=_progress("save"), max_shard_size=args.max_shard_size
        )
    if args.json:
        _print_json({"file": args.file, "bytes": written})
    else:
        print(f"{format_size(written)} of tensors to {args.file}")
    return 0


def size(text: str) -> int:
    """An argparse type: a size (5GB, 500MiB, bytes), more than 0."""
    from .._defaults import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0")
    return value


def seconds(text: str) -> float:
    """An argparse type: a number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def push(args: argparse.Namespace) -> int:
    """``tensordepot push``: send tensors to a broker on another host."""
    with connect(args) as c:
        for name in args.names:
            version = c.push(name, args.to, token=args.to_token, tls_ca=args.tls_ca)
            print(f"{name}: version {version} at {args.to}")
    return 0
