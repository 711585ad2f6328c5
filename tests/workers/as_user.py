"""Run a snippet as another Unix user: ``as_user.py UID GID GROUPS CODE [ARG...]``.

Started as root, it imports everything first (the interpreter and the
packages may live where the other user cannot read, such as /root), then
drops root's privileges for good (real, effective and saved ids), then runs
CODE with ``ARGS`` and ``emit(obj)`` (one JSON line on stdout) in scope.
From the kernel's point of view the snippet is that user: SO_PEERCRED,
file permissions and /proc all see its uid.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (getaddrinfo's host codec, loaded lazily otherwise)
import errno  # noqa: F401
import grp  # noqa: F401  (imported before the drop: lib-dynload may be unreadable after it)
import http.client  # noqa: F401
import json
import os
import pwd  # noqa: F401
import socket  # noqa: F401
import sys
import traceback

import numpy as np  # noqa: F401
import tensordepot
import tensordepot.cli
import tensordepot.client
import tensordepot.service._http._server
import tensordepot.service.app  # noqa: F401


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


uid, gid = int(sys.argv[1]), int(sys.argv[2])
groups = [int(g) for g in sys.argv[3].split(",") if g]
os.setgroups(groups)
os.setgid(gid)  # before setuid, which takes away the right to change groups
os.setuid(uid)  # as root this sets the real, effective and saved uid: no way back
assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) == (uid, uid, gid, gid)
os.chdir("/")
try:
    exec(
        compile(sys.argv[4], "<as_user snippet>", "exec"),  # the tests' own code
        {"__name__": "__snippet__", "ARGS": sys.argv[5:], "emit": emit},
    )
except SystemExit:
    raise
except BaseException:  # print it while traceback is importable, then fail
    traceback.print_exc()
    sys.exit(1)
