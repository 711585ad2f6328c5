"""Another process of the same user that learnt a session id (a log line, a
shared notebook) and uses it: ``session_thief.py SOCKET SESSION LEASE``.

Raw HTTP over the broker's unix socket, so the kernel reports this
process's own pid (SO_PEERCRED).  Prints one JSON line: route -> [status,
error code or None, error message or None].
"""

from __future__ import annotations

import http.client
import json
import socket
import sys


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def call(
    path: str, method: str, target: str, body: object = None, headers: dict[str, str] | None = None
) -> list[object]:
    conn = _Unix(path)
    try:
        h = {"content-type": "application/json", **(headers or {})}
        conn.request(method, target, body=None if body is None else json.dumps(body), headers=h)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    err = json.loads(data)["error"] if r.status >= 400 and data else {}
    return [r.status, err.get("code"), err.get("message")]


def main() -> None:
    path, sid, lease = sys.argv[1], sys.argv[2], sys.argv[3]
    mine = {"x-tensordepot-session": sid}
    tried = {
        "heartbeat": call(path, "POST", f"/v1/sessions/{sid}/heartbeat", headers=mine),
        "release": call(path, "POST", "/v1/release", {"leases": [int(lease)]}, headers=mine),
        "piggyback": call(
            path, "GET", "/v1/stat", headers={**mine, "x-tensordepot-release": lease}
        ),
        "put": call(
            path,
            "POST",
            "/v1/alloc",
            {"name": "stolen", "shape": [1 << 20], "dtype": "uint8"},
            headers=mine,
        ),
        "fork": call(path, "POST", f"/v1/sessions/{sid}/fork", headers=mine),
        "get": call(path, "GET", "/v1/tensors/w", headers=mine),
        "close": call(path, "DELETE", f"/v1/sessions/{sid}", headers=mine),
    }
    print(json.dumps(tried), flush=True)


if __name__ == "__main__":
    main()
