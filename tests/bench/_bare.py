"""A bare FastAPI endpoint, served like the broker: the B5 peer.

    python tests/bench/_bare.py /tmp/dir/bare.sock

The uvicorn settings are the broker's (cli/_serve.py): httptools, a unix
socket bound by us with mode 0600, lifespan on, no access log.  The endpoint
returns a constant JSON body of the size of a get's handle, with the header
by which the client recognises a broker, and does nothing else, so the gap to
the broker is the broker's own work.
"""

from __future__ import annotations

import os
import socket
import sys

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from tensordepot._proto import SERVER_HEADER
from tensordepot._version import __version__

HANDLE = {
    "name": "b5.small",
    "version": 1,
    "kind": "posix",
    "segment": "tensordepot-0123456789-0123456789abcdef0123456789abcdef",
    "offset": 4096,
    "nbytes": 1024,
    "shape": [256],
    "strides": [1],
    "dtype": "float32",
    "device": "cpu",
    "state": "ready",
    "lease": 1,
}


def create_app() -> FastAPI:
    app = FastAPI()
    marked = {SERVER_HEADER: __version__}

    @app.get("/v1/tensors/{name:path}")
    async def get_tensor(name: str) -> JSONResponse:
        return JSONResponse(HANDLE, headers=marked)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"}, headers=marked)

    return app


def main(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)  # a leftover of an earlier run in the same directory
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(1024)
    config = uvicorn.Config(
        create_app(),
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
        log_level="warning",
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1])
