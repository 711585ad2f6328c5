"""The ``tensordepot`` command, run as users run it: the real console script
in the test's venv, as a subprocess, against a real broker."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _harness import ROOT, TENSORDEPOT, TEST_PREFIX, BrokerProc, cli, ok, shm_entries
from tensordepot import __version__
from tensordepot._defaults import parse_size
from tensordepot.cli import build_parser, format_size
from tensordepot.service.config import Settings

HEAVY = ("fastapi", "uvicorn", "starlette", "prometheus_client")


def assert_no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr and "Exception" not in res.stderr, res.stderr


@pytest.fixture
def filled(broker: BrokerProc) -> BrokerProc:
    with broker.client() as c:
        c.put("weights", np.zeros((3, 1 << 20), np.float32))  # 12 MiB
        c.put("bias", np.zeros(192, np.float64))  # 1.5 KiB
    return broker


# -- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        pytest.param(0, "0 B", id="zero"),
        pytest.param(1023, "1023 B", id="bytes"),
        pytest.param(1024, "1 KiB", id="kib"),
        pytest.param(1536, "1.5 KiB", id="fraction"),
        pytest.param(3 << 30 >> 1, "1.5 GiB", id="gib"),
        pytest.param((1 << 20) - 1, "1 MiB", id="rounds-up-a-unit"),
        pytest.param(100 << 40, "100 TiB", id="tib"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize(
    ("text", "n"),
    [
        pytest.param("8GiB", 8 << 30, id="gib"),
        pytest.param("512MiB", 512 << 20, id="mib"),
        pytest.param("1000000", 1_000_000, id="plain"),
        pytest.param(4096, 4096, id="int"),
        pytest.param("0", 0, id="zero"),
        pytest.param("1.5GiB", 3 << 29, id="fraction"),
        pytest.param("2GB", 2 * 1000**3, id="decimal"),
        pytest.param("4k", 4000, id="k"),
        pytest.param("16 mib", 16 << 20, id="lower-case-and-space"),
        pytest.param("100TiB", 100 << 40, id="tib"),
    ],
)
def test_parse_size(text: str | int, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "-1GiB", "", "8 GiBs", "1e3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


# -- serve's flags are the settings -------------------------------------------------------------


def serve_parser() -> Any:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_setting_has_one_flag_whose_help_is_its_description() -> None:
    """One help text per setting: the flag's help is the field's own description."""
    actions = [a for a in serve_parser()._actions if a.dest != "help"]
    for name, field in Settings.model_fields.items():
        flags = [a for a in actions if a.dest == name]
        assert len(flags) == 1, (name, flags)
        [action] = flags
        assert action.option_strings == ["--" + name.replace("_", "-")], action.option_strings
        assert field.description and action.help == field.description, name
    assert sorted(a.dest for a in actions) == sorted(Settings.model_fields), "a flag, no setting"


def test_serve_help_names_each_variable_once() -> None:
    out = ok("serve", "--help")
    for name in Settings.model_fields:
        assert len(re.findall(rf"\$TENSORDEPOT_{name.upper()}\b", out)) == 1, name


def test_every_serve_flag_the_readme_uses_parses() -> None:
    readme = (ROOT / "README.md").read_text()
    used = set()
    for line in readme.splitlines():
        if "tensordepot serve" in line:
            used |= {
                w.split("=")[0]
                for w in line.split("tensordepot serve", 1)[1].split()
                if w.startswith("--")
            }
    known = {s for a in serve_parser()._actions for s in a.option_strings}
    assert used and used <= known, sorted(used - known)


def test_serve_flags_keep_their_kinds() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--listen",
            "unix:///a.sock",
            "--listen",
            "http://127.0.0.1:1",
            "--peer",
            "grpc://h:1",
            "--insecure-no-auth",
            "--reap-interval",
            "0.25",
            "--max-sessions",
            "8",
            "--max-memory",
            "1GiB",
        ]
    )
    assert args.listen == ["unix:///a.sock", "http://127.0.0.1:1"] and args.peer == ["grpc://h:1"]
    assert args.insecure_no_auth is True and args.reap_interval == 0.25 and args.max_sessions == 8
    assert args.max_memory == "1GiB" and args.token is None and args.allow_uid is None
    bare = build_parser().parse_args(["serve"])
    unset = [name for name in Settings.model_fields if getattr(bare, name) is not None]
    assert not unset, f"flags left out override the environment: {unset}"


# -- what the client commands import -----------------------------------------------------------


def imported(*args: str, env: dict[str, str] | None = None) -> set[str]:
    """Top-level modules the real ``tensordepot`` command imports (python -X importtime)."""
    res = cli(*args, env={"PYTHONPROFILEIMPORTTIME": "1", **(env or {})})
    assert res.returncode in (0, 1), res.stderr[-2000:]
    mods = set()
    for line in res.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            mods.add(name.split(".")[0])
    assert "tensordepot" in mods, res.stderr[-2000:]
    return mods


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["--version"], id="version"),
        pytest.param(["ls"], id="ls"),
        pytest.param(["stat", "--json"], id="stat"),
        pytest.param(["rm", "weights"], id="rm"),
        pytest.param(["wait", "--timeout", "5"], id="wait"),
    ],
)
def test_client_commands_import_neither_fastapi_nor_uvicorn(
    filled: BrokerProc, args: list[str]
) -> None:
    mods = imported(*args, env={"TENSORDEPOT_URL": filled.url})
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))


def test_serve_still_loads_the_broker(tmp_path: Path) -> None:
    """The other side of the lazy package: ``tensordepot.service`` names still resolve."""
    code = (
        "import sys, tensordepot.service as s; assert 'fastapi' not in sys.modules; "
        "print(s.create_app.__module__, s.Broker.__module__, s.Settings.__module__, "
        "'fastapi' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    )
    assert res.stdout.split() == [
        "tensordepot.service.app",
        "tensordepot.service._registry._broker",
        "tensordepot.service.config",
        "True",
    ]


# -- version, sizes, json ----------------------------------------------------------------------


def test_version() -> None:
    assert ok("--version") == f"tensordepot {__version__}\n"


def test_ls_shows_human_sizes_and_bytes_on_request(filled: BrokerProc) -> None:
    rows = [line.split() for line in ok("ls", "--url", filled.url).splitlines()]
    assert rows[0] == ["NAME", "VER", "DTYPE", "SHAPE", "SIZE", "READERS", "STATE"]
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["weights"][-4:] == ["12", "MiB", "0", "ready"], rows
    assert by_name["bias"][-4:] == ["1.5", "KiB", "0", "ready"], rows

    rows = [line.split() for line in ok("ls", "--bytes", "--url", filled.url).splitlines()]
    assert rows[0][4] == "BYTES"
    assert {r[0]: r[-3] for r in rows[1:]} == {"weights": str(12 << 20), "bias": "1536"}


def test_stat_shows_human_sizes_and_bytes_on_request(filled: BrokerProc) -> None:
    shown = dict(line.split(None, 1) for line in ok("stat", "--url", filled.url).splitlines())
    assert shown["bytes_in_use"] == format_size((12 << 20) + 1536) == "12 MiB"
    assert shown["max_memory"] == "2 GiB" and shown["tensors"] == "2"
    raw = dict(
        line.split(None, 1) for line in ok("stat", "--bytes", "--url", filled.url).splitlines()
    )
    assert raw["bytes_in_use"] == str((12 << 20) + 1536) and raw["max_memory"] == str(2 << 30)


def test_every_client_command_speaks_json(filled: BrokerProc) -> None:
    env = {"TENSORDEPOT_URL": filled.url}
    items = json.loads(ok("ls", "--json", env=env))
    assert {i["name"]: i["nbytes"] for i in items} == {"weights": 12 << 20, "bias": 1536}
    st = json.loads(ok("stat", "--json", env=env))
    assert st["tensors"] == 2 and st["bytes_in_use"] == (12 << 20) + 1536
    waited = json.loads(ok("wait", "--json", env=env))
    assert waited["status"] == "ok" and waited["version"] == __version__
    assert waited["url"] == filled.url and waited["waited"] >= 0
    res = cli("rm", "--json", "bias", "nothing-here", env=env)
    assert res.returncode == 1, res.stderr
    assert json.loads(res.stdout) == {
        "deleted": ["bias"],
        "missing": ["nothing-here"],
        "refused": {},
    }


# -- rm ----------------------------------------------------------------------------------------


def test_rm_goes_on_past_missing_names(broker: BrokerProc) -> None:
    with broker.client() as c:
        for name in ("a", "c", "keep"):
            c.put(name, np.ones(4))
    res = cli("rm", "a", "missing", "c", "gone", "--url", broker.url)
    assert res.returncode == 1, res.stderr
    assert_no_traceback(res)
    assert res.stderr.splitlines() == [
        "tensordepot rm: cannot remove 'missing': no such tensor",
        "tensordepot rm: cannot remove 'gone': no such tensor",
    ]
    with broker.client() as c:
        assert [i.name for i in c.list()] == ["keep"]
    assert ok("rm", "keep", "--url", broker.url) == ""  # all present: silent, exit 0


# -- a closed pipe -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [pytest.param([], id="table"), pytest.param(["--json"], id="json")]
)
def test_ls_into_a_closed_pipe_exits_quietly(filled: BrokerProc, args: list[str]) -> None:
    """``tensordepot ls | head -1``, made deterministic: the reader is gone before
    the first write, so every write fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = cli("ls", *args, "--url", filled.url, stdout=w)
    finally:
        os.close(w)
    assert res.stderr == "", res.stderr
    assert res.returncode == 128 + signal.SIGPIPE


def test_ls_into_head_exits_quietly(filled: BrokerProc) -> None:
    """The shell pipeline itself, with more rows than head reads."""
    with filled.client() as c:
        # Far more than a pipe buffer (64 KiB) holds: ls is still writing when head exits.
        c.put_many({f"t{i:04d}-{'x' * 100}": np.zeros(1) for i in range(1000)})
    script = f'"{TENSORDEPOT}" ls --url "$1" | head -1; echo "status ${{PIPESTATUS[0]}}" >&2'
    res = subprocess.run(
        ["bash", "-c", script, "sh", filled.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.stdout.split()[0] == "NAME"
    status = res.stderr.splitlines()[-1]
    assert res.stderr.splitlines()[:-1] == [], res.stderr
    assert status == f"status {128 + signal.SIGPIPE}", status


# -- wait --------------------------------------------------------------------------------------


def test_wait_returns_at_once_when_the_broker_answers(broker: BrokerProc) -> None:
    t0 = time.monotonic()
    out = ok("wait", "--url", broker.url, "--timeout", "30")
    assert out.startswith(f"broker ready at {broker.url} (tensordepot {__version__}"), out
    assert time.monotonic() - t0 < 15


def test_wait_times_out_with_a_clear_message(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/nobody.sock"
    t0 = time.monotonic()
    res = cli("wait", "--url", url, "--timeout", "0.5")
    took = time.monotonic() - t0
    assert res.returncode == 1 and res.stdout == ""
    assert_no_traceback(res)
    assert f"no broker answered at {url} within 0.5 s" in res.stderr, res.stderr
    assert "tensordepot serve" in res.stderr
    assert 0.5 <= took < 30, took


def test_wait_refuses_a_bad_timeout() -> None:
    for bad in ("-1", "soon", "nan"):
        res = cli("wait", "--timeout", bad)
        assert res.returncode == 2 and "not a number of seconds" in res.stderr, res.stderr


def test_serve_then_wait(broker_factory: Callable[..., BrokerProc], tmp_path: Path) -> None:
    """The README's ``tensordepot serve & tensordepot wait``: wait runs first,
    the broker comes up later, and wait returns 0 once it answers."""
    sock_dir = str(tmp_path)
    url = f"unix://{sock_dir}/broker.sock"
    waiter = subprocess.Popen(
        [TENSORDEPOT, "wait", "--url", url, "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        b = broker_factory(sock_dir=sock_dir)
        assert b.url == url
        out, err = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    assert waiter.returncode == 0, err
    assert out.startswith(f"broker ready at {url}"), out


# -- serve's sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        pytest.param(
            ["--max-memory", "0"],
            {},
            "--max-memory (or $TENSORDEPOT_MAX_MEMORY) is '0', which leaves no memory",
            id="zero",
        ),
        pytest.param(
            ["--max-memory", "0.1"], {}, "is '0.1', which leaves no memory", id="under-a-byte"
        ),
        pytest.param(
            [], {"TENSORDEPOT_MAX_MEMORY": "0"}, "is '0', which leaves no memory", id="zero-env"
        ),
        pytest.param(
            ["--max-memory=-1GiB"],
            {},
            "--max-memory (or $TENSORDEPOT_MAX_MEMORY): not a size",
            id="negative",
        ),
        pytest.param(
            ["--max-memory", "lots"],
            {},
            "--max-memory (or $TENSORDEPOT_MAX_MEMORY): not a size",
            id="unparsable",
        ),
        pytest.param(
            ["--segment-size", "big"],
            {},
            "--segment-size (or $TENSORDEPOT_SEGMENT_SIZE): not a size",
            id="segment-size",
        ),
        pytest.param(
            [],
            {"TENSORDEPOT_REAP_INTERVAL": "0"},
            "--reap-interval (or $TENSORDEPOT_REAP_INTERVAL): Input should be greater than 0",
            id="env-out-of-range",
        ),
    ],
)
def test_serve_refuses_sizes_that_hold_nothing(
    tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    sock = tmp_path / "b.sock"
    prefix = f"{TEST_PREFIX}{secrets.token_hex(4)}-"
    res = cli(
        "serve",
        "--listen",
        f"unix://{sock}",
        "--shm-prefix",
        prefix,
        "--prealloc",
        "0",
        *args,
        env=env,
        timeout=30,
    )
    assert res.returncode == 2, res.stderr
    assert_no_traceback(res)
    line = res.stderr.strip()
    assert line.startswith("tensordepot serve: ") and says in line, line
    assert "\n" not in line
    assert not sock.exists() and shm_entries(prefix) == []


def test_serve_warns_when_max_memory_exceeds_dev_shm(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    b = broker_factory(max_memory="100TiB")
    warnings = [ln for ln in b.log().splitlines() if "WARNING" in ln]
    assert len(warnings) == 1, b.log()
    assert "--max-memory 100 TiB is more than /dev/shm holds" in warnings[0], warnings
    assert "out of memory" in warnings[0] and "shm_size" in warnings[0]


def test_serve_within_dev_shm_does_not_warn(broker: BrokerProc) -> None:
    assert "WARNING" not in broker.log(), broker.log()
