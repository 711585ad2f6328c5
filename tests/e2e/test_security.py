"""Security properties of a real broker: who can connect, who can map memory,
and what an exposed TCP listener requires."""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _harness import TEST_PREFIX, BrokerProc, free_port, serve_once, shm_entries, wait_for
from tensordepot import AuthError, Client
from tensordepot.shm import PosixSegment


def test_socket_is_0600_in_a_0700_directory(
    broker_factory: Callable[..., BrokerProc], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The broker creates a missing socket directory itself; AF_UNIX paths are short.
    parent = os.path.join(str(tmp_path_factory.mktemp("sec", numbered=True)), "run")
    sock = os.path.join(parent, "b.sock")
    b = broker_factory("--listen", f"unix://{sock}")
    for path in (b.sock, sock):
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    assert os.stat(parent).st_mode & 0o777 == 0o700
    with Client(f"unix://{sock}") as c:
        assert c.stat().sessions >= 1


def test_segments_are_0600_with_128_bit_random_names(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    broker = broker_factory("--segment-size", "16MiB")
    with broker.client() as c:
        c.put("small", np.zeros(10))
        c.put("pooled", np.zeros(1 << 16))
        c.put("dedicated", np.zeros(12 << 20, dtype=np.uint8))  # over half a pool segment
        names = broker.segments()
        segments = [n for n in names if n != broker.prefix + "lock"]
        assert len(segments) == 2 and broker.prefix + "lock" in names
        for name in names:
            mode = os.stat(f"/dev/shm/{name}").st_mode & 0o777
            assert mode == 0o600, (name, oct(mode))
        for name in segments:
            assert re.fullmatch(re.escape(broker.prefix) + "[0-9a-f]{32}", name), name


def test_a_precreated_segment_name_is_never_attached(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Segments are created O_EXCL: a name someone planted is an error, not a shared mapping."""
    name = f"{TEST_PREFIX}planted-{secrets.token_hex(16)}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    try:
        os.write(fd, b"attacker")
        with pytest.raises(FileExistsError):
            PosixSegment(name, 1 << 20)
        assert os.path.exists(path), "the failed create must not unlink someone else's file"
        with open(path, "rb") as f:
            assert f.read() == b"attacker"
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize(
    "host",
    [
        pytest.param("0.0.0.0", id="ipv4-any"),
        pytest.param("[::]", id="ipv6-any"),
        pytest.param("127.0.0.1", id="loopback"),
    ],
)
def test_tcp_without_token_refuses_to_start(host: str) -> None:
    """Loopback too: every local user can reach it."""
    port = free_port("0.0.0.0")
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    url = f"http://{host}:{port}"
    for res in (
        serve_once("--listen", url, "--shm-prefix", prefix),
        serve_once(env={"TENSORDEPOT_LISTEN": url, "TENSORDEPOT_SHM_PREFIX": prefix}),
    ):
        assert res.returncode == 1, (res.returncode, res.stderr)
        assert f"--listen {url} needs a token" in res.stderr, res.stderr
        assert "--token-file PATH (or TENSORDEPOT_TOKEN)" in res.stderr, res.stderr
        assert "--insecure-no-auth" in res.stderr, res.stderr
        assert "tensordepot ready" not in res.stdout + res.stderr
        assert "Traceback" not in res.stderr
    assert shm_entries(prefix) == []
    with socket.socket() as s, pytest.raises(OSError):
        s.connect(("127.0.0.1", port))  # nothing was left listening


def test_tcp_needs_the_token_and_unix_does_not(
    broker_factory: Callable[..., BrokerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORDEPOT_TOKEN", raising=False)
    token = secrets.token_urlsafe(24)
    port = free_port("0.0.0.0")
    b = broker_factory(
        "--listen", f"http://0.0.0.0:{port}", env={"TENSORDEPOT_TOKEN": token}
    )  # env, not argv: argv is world-readable
    tcp = f"http://127.0.0.1:{port}"

    with pytest.raises(AuthError, match="missing or wrong token"):
        Client(tcp)
    with pytest.raises(AuthError):
        Client(tcp, token="not-" + token)
    req = urllib.request.Request(f"{tcp}/v1/stat")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 401
    assert info.value.headers["www-authenticate"] == "Bearer"
    assert json.loads(info.value.read())["error"]["code"] == "unauthorized"

    data = np.arange(300_000, dtype=np.float32)  # alloc + publish, not the inline path
    with Client(tcp, token=token) as c:
        c.put("over-tcp", data)
        assert np.array_equal(np.from_dlpack(c.get("over-tcp")), data)
    monkeypatch.setenv("TENSORDEPOT_TOKEN", token)
    with Client(tcp) as c:  # $TENSORDEPOT_TOKEN is the default
        assert [i.name for i in c.list()] == ["over-tcp"]
    monkeypatch.delenv("TENSORDEPOT_TOKEN")

    # On the unix socket the kernel vouches for the peer's uid (ours): no token is asked for.
    with b.client() as c:
        assert np.array_equal(np.from_dlpack(c.get("over-tcp")), data)

    cli = [sys.executable, "-m", "tensordepot", "stat", "--url", tcp]
    env = {k: v for k, v in os.environ.items() if k != "TENSORDEPOT_TOKEN"}
    res = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1 and "missing or wrong token" in res.stderr, res.stderr
    # --token=VALUE: a random token may start with "-", which argparse would take for an option.
    res = subprocess.run(
        [*cli, f"--token={token}"], check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0 and "bytes_in_use" in res.stdout, res.stderr
    assert "--token is visible to every local user in the process list" in res.stderr


def test_insecure_no_auth_starts_and_warns_on_each_connection(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    port = free_port()
    b = broker_factory("--listen", f"http://127.0.0.1:{port}", "--insecure-no-auth")
    assert "TCP listeners run with --insecure-no-auth" in b.log()

    def warnings() -> int:
        return b.log().count("unauthenticated TCP connection from 127.0.0.1:")

    first = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    second = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(3):  # one connection, several requests: one warning
            first.request("GET", "/v1/stat")
            with first.getresponse() as r:
                assert r.status == 200, r.read()
                r.read()
        wait_for(lambda: warnings() == 1, what="a warning for the first connection")
        second.request("GET", "/v1/stat")
        with second.getresponse() as r:
            assert r.status == 200
            r.read()
        wait_for(lambda: warnings() == 2, what="a warning for the second connection")
    finally:
        first.close()
        second.close()
    assert warnings() == 2

    # A token and --insecure-no-auth contradict each other.
    res = serve_once(
        "--listen",
        f"http://127.0.0.1:{free_port()}",
        "--insecure-no-auth",
        env={"TENSORDEPOT_TOKEN": secrets.token_urlsafe(24)},
    )
    assert res.returncode == 2 and "drop one of the two" in res.stderr, res.stderr


def test_token_on_the_command_line_warns(broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory(
        "--listen", f"http://127.0.0.1:{free_port()}", f"--token={secrets.token_urlsafe(24)}"
    )
    assert "--token is visible to every local user in the process list (/proc/" in b.log()


def test_short_tokens_and_bad_token_files_refuse_to_start(tmp_path: Path) -> None:
    tcp = f"http://127.0.0.1:{free_port()}"
    res = serve_once("--listen", tcp, env={"TENSORDEPOT_TOKEN": "short"})
    assert res.returncode == 2, res.stderr
    assert "at least 16 printable ASCII characters" in res.stderr, res.stderr
    secret = secrets.token_urlsafe(24)
    path = tmp_path / "tokens"
    for text, mode, expect in (
        (f"{secret} admin\n", 0o644, "other users can read or change the tokens; chmod 600"),
        (f"{secret} superuser\n", 0o600, "line 1: write '<token> <scope>"),
        (f"# ops\n\n{secret} read path=x\n", 0o600, "line 3: unknown option 'path'"),
        (f"{secret} read\n{secret} write\n", 0o600, "configured twice"),
        ("# nothing\n", 0o600, "holds no token"),
    ):
        path.write_text(text)
        path.chmod(mode)
        res = serve_once("--listen", tcp, "--token-file", str(path))
        assert res.returncode == 2 and expect in res.stderr, (text, res.stderr)
        assert secret not in res.stderr + res.stdout, "a message must never show a token"
