"""The parser of the ``tensordepot`` command, and its entry point.

Every client command takes ``--json``; the exit status is 0 on success, 1
on failure, 2 on a usage error.  The flags of ``serve`` are made from the
broker's ``Settings`` (``_flags``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .._defaults import default_url
from .._version import __version__
from . import _commands
from ._flags import add_settings, formatter
from ._serve import serve


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``tensordepot`` command."""
    # Settings only: pydantic-settings, not the broker, FastAPI or uvicorn.
    from ..service.config import Settings

    p = argparse.ArgumentParser(prog="tensordepot", description="Zero-copy tensor exchange broker.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    fields = dict(Settings.model_fields)
    s = sub.add_parser(
        "serve",
        help="run the broker in the foreground",
        formatter_class=formatter(fields),
        description="Every flag is also an environment variable, "
        "TENSORDEPOT_<FLAG> (--max-memory is TENSORDEPOT_MAX_MEMORY); "
        "flags win.",
    )
    add_settings(s, fields)
    s.set_defaults(func=serve)

    commands = (
        ("ls", _commands.ls, "list tensors"),
        ("stat", _commands.stat, "show memory and lifetime accounting"),
        ("who", _commands.who, "show which process holds leases on which names and versions"),
        (
            "rm",
            _commands.rm,
            "delete tensors (names, or --prefix); goes on past missing names (exit 1 if any)",
        ),
        ("wait", _commands.wait, "wait until the broker answers (exit 0), or time out (exit 1)"),
        (
            "load",
            _commands.load,
            "put every tensor of safetensors files (a file, several, a "
            "folder of shards or its index), in one batch",
        ),
        (
            "save",
            _commands.save,
            "write the tensors under a prefix to a safetensors file, or "
            "to shards and an index (--max-shard-size)",
        ),
    )
    for name, fn, helptext in commands:
        c = sub.add_parser(name, help=helptext, description=helptext)
        c.add_argument(
            "--url", default=None, help=f"broker URL (default $TENSORDEPOT_URL or {default_url()})"
        )
        c.add_argument(
            "--token", default=None, help="bearer token for TCP (default $TENSORDEPOT_TOKEN)"
        )
        c.add_argument("--json", action="store_true", help="print JSON")
        if name in ("ls", "stat", "who"):
            c.add_argument("--bytes", action="store_true", help="sizes as byte counts, not 1.5 GiB")
        if name == "ls":
            c.add_argument("--prefix", default="", metavar="P", help="only names that start with P")
        if name == "rm":
            c.add_argument("names", nargs="*", metavar="NAME")
            c.add_argument(
                "--prefix",
                default=None,
                metavar="P",
                help="also every name that starts with P, in one request",
            )
        if name == "load":
            c.add_argument(
                "files",
                nargs="+",
                metavar="FILE",
                help="a safetensors file, several, a folder of shards, or an index "
                "(model.safetensors.index.json)",
            )
            c.add_argument(
                "--prefix",
                default="",
                metavar="P",
                help="put each tensor as P + its name in the file",
            )
        if name == "save":
            c.add_argument("prefix", metavar="PREFIX")
            c.add_argument(
                "file", metavar="PATH", help="the file to write; with --max-shard-size, the folder"
            )
            c.add_argument(
                "--max-shard-size",
                type=_commands.size,
                default=None,
                metavar="SIZE",
                help="write shards of at most SIZE (5GB, 500MiB) into the folder PATH, "
                "and model.safetensors.index.json, as save_pretrained does",
            )
        if name == "wait":
            c.add_argument(
                "--timeout",
                type=_commands.seconds,
                default=30.0,
                metavar="S",
                help="give up after S seconds (default 30)",
            )
        c.set_defaults(func=fn)

    push = sub.add_parser("push", help="send tensors to a broker on another host (Arrow Flight)")
    push.add_argument("names", nargs="+", metavar="NAME")
    push.add_argument(
        "--to",
        required=True,
        metavar="URL",
        help="the other broker's --flight URL, grpc://HOST:PORT or grpc+tls://HOST:PORT",
    )
    push.add_argument(
        "--url",
        default=None,
        help=f"local broker URL (default $TENSORDEPOT_URL or {default_url()})",
    )
    push.add_argument("--token", default=None, help="bearer token for the local broker over TCP")
    push.add_argument(
        "--to-token",
        default=None,
        help="token for the other broker (default $TENSORDEPOT_PEER_TOKEN)",
    )
    push.add_argument(
        "--tls-ca", default=None, metavar="PEM", help="CA bundle for a grpc+tls:// --to"
    )
    push.set_defaults(func=_commands.push)
    return p


def _closed_pipe() -> int:
    """The reader of stdout went away (``tensordepot ls | head -1``).

    Python ignores SIGPIPE, so the write raised EPIPE instead of ending the
    process.  Point stdout at /dev/null, so that the interpreter's last flush
    cannot fail again, and exit as the shell reports a tool that SIGPIPE
    ended (128 + 13), without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Run ``tensordepot`` with ``argv`` (default: the command line); the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return int(args.func(args))
    from .._errors import DepotError

    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except DepotError as exc:
        print(f"tensordepot {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return rc
