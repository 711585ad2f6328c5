"""Without cupy: ``import tensordepot``, the broker and every CPU path work,
and GPU requests are refused with the reason.

``tests/workers/nocupy`` holds a ``sitecustomize`` that makes ``import
cupy`` fail; on PYTHONPATH it turns a process into one on a machine without
cupy, whether or not cupy is installed here.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from _harness import WORKERS, BrokerProc, run_worker

NOCUPY = WORKERS / "nocupy"
UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def no_cupy_env() -> dict[str, str]:
    paths = (str(NOCUPY), os.environ.get("PYTHONPATH", ""))
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_import_and_app_without_cupy() -> None:
    code = (
        "import sys\n"
        "try:\n    import cupy\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('not blocked')\n"
        "import tensordepot, tensordepot.shm, tensordepot.client, tensordepot.service\n"
        "from tensordepot.service.app import create_app\n"
        "from tensordepot.shm import _cuda\n"
        "create_app()\n"
        "assert 'cupy' in (_cuda.unavailable() or ''), _cuda.unavailable()\n"
        "assert not [m for m in sys.modules if m.startswith('cupy')], 'cupy was imported'\n"
        "print('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **no_cupy_env()},
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def request(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    sock_path = url.removeprefix("unix://")

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(self.timeout)
            self.sock.connect(sock_path)

    conn = Conn("localhost", timeout=30)
    try:
        conn.request(
            method,
            path,
            json.dumps(body) if body is not None else None,
            {"content-type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def test_broker_and_cpu_paths_without_cupy(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory(env=no_cupy_env())
    run_worker("nocupy_client", b.url, env=no_cupy_env())
    status, session = request(b.url, "POST", "/v1/sessions", {"pid": os.getpid()})
    assert status == 200
    headers = {"x-tensordepot-session": session["session"]}
    for device, match in (
        (f"cuda:{UUID}", "cannot hold GPU memory: cupy is not installed"),
        ("cuda:0", "name the GPU by UUID"),
    ):
        status, body = request(
            b.url,
            "POST",
            "/v1/alloc",
            {"name": "g", "shape": [4], "dtype": "float32", "device": device},
            headers,
        )
        assert status == 400 and match in body["error"]["message"], body
    status, body = request(b.url, "GET", "/v1/stat")
    assert status == 200 and body["devices"] == [] and body["tensors"] == 0
    assert request(b.url, "DELETE", f"/v1/sessions/{session['session']}")[0] == 204
    assert "Traceback" not in b.log()
