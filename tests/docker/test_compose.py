"""docker/: the compose files are valid Compose, wire the broker and workers
together as DESIGN.md requires, and their commands work.

No Docker engine is needed.  The files are checked against the Compose
Specification's JSON schema (tests/docker/compose-spec.json, shipped with
the tests; its origin and licence are in compose-spec.NOTICE.md), and the
broker and the example worker are run as plain processes with exactly the
command and environment the compose file gives them; only the container
paths are mapped onto host paths (the socket volume onto a temporary
directory, the files the Dockerfile copies onto the repository's).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from _harness import free_port, shm_entries, wait_for
from tensordepot._defaults import ENV_TOKEN, ENV_URL, parse_size
from tensordepot.service import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SCHEMA = Path(__file__).resolve().parent / "compose-spec.json"
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))
HOSTS = DOCKER / "compose.hosts.yaml"  # a whole example of its own: two hosts
OVERRIDES = [p for p in COMPOSE_FILES if p.name not in ("compose.yaml", HOSTS.name)]
# What the overrides need from the environment to interpolate (compose.tcp.yaml
# refuses to start without a token, as the broker does).
OVERRIDE_ENV = {ENV_TOKEN: "a-long-random-secret"}

# -- reading the files ----------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<plain>\w+))"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ``$$``, ``${V}``, ``${V:-default}``,
    ``${V-default}``, ``${V:?error}``, ``${V?error}``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("plain")
        op, arg, got = m.group("op"), m.group("arg"), env.get(name)
        unset = got is None or (got == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset or got is None else got
        if op in (":?", "?") and unset:
            raise KeyError(f"compose needs ${name}: {arg}")
        return got or ""

    return _VAR.sub(sub, value)


def load(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc if env is None else interpolate(doc, env)


def merge(base: Any, override: Any) -> Any:
    """``docker compose -f base -f override``: mappings merge, the rest is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return override


def docker_size(text: str) -> int:
    """docker's byte units (shm_size): b, k, m, g, binary."""
    m = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(text).strip().lower())
    assert m, f"not a docker size: {text!r}"
    return int(m.group(1)) << (10 * "bkmg".index(m.group(2) or "b"))


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of docker/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copies() -> dict[str, Path]:
    """Image path -> repository path, for every COPY in the Dockerfile."""
    out = {}
    for word, rest in dockerfile():
        if word == "COPY":
            *sources, dest = shlex.split(rest)
            for src in sources:
                out[dest if len(sources) == 1 else f"{dest.rstrip('/')}/{Path(src).name}"] = (
                    ROOT / src
                )
    return out


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    assert SCHEMA.is_file(), f"{SCHEMA} is missing: the suite ships it (see compose-spec.NOTICE.md)"
    loaded: dict[str, Any] = json.loads(SCHEMA.read_text())
    return loaded


def errors(schema: dict[str, Any], doc: Any) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


# -- static checks ------------------------------------------------------------------


def test_there_is_a_compose_file_and_a_gpu_variant() -> None:
    names = {p.name for p in COMPOSE_FILES}
    assert {"compose.yaml", "compose.gpu.yaml", HOSTS.name} <= names, names


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in COMPOSE_FILES])
def test_compose_file_matches_the_spec(schema: dict[str, Any], path: Path) -> None:
    assert errors(schema, load(path)) == []
    assert errors(schema, load(path, OVERRIDE_ENV)) == []


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in OVERRIDES])
def test_merged_with_an_override_matches_the_spec(schema: dict[str, Any], path: Path) -> None:
    merged = merge(load(DOCKER / "compose.yaml", OVERRIDE_ENV), load(path, OVERRIDE_ENV))
    assert errors(schema, merged) == []
    assert set(merged["services"]) == set(load(DOCKER / "compose.yaml")["services"]), (
        "an override adds no service of its own"
    )


def test_the_schema_check_can_fail(schema: dict[str, Any]) -> None:
    doc = load(DOCKER / "compose.yaml")
    doc["services"]["broker"]["ipc"] = 5
    doc["services"]["broker"]["shm_sise"] = "8gb"
    found = errors(schema, doc)
    assert any("ipc" in e for e in found) and any("shm_sise" in e for e in found), found


def test_workers_share_the_brokers_ipc_pid_and_socket() -> None:
    services = load(DOCKER / "compose.yaml", {})["services"]
    broker = services.pop("broker")
    assert services, "compose.yaml has an example worker"
    assert broker["ipc"] == "shareable"
    target = {v.split(":")[0]: v.split(":")[1] for v in broker["volumes"]}
    listen = broker["environment"]["TENSORDEPOT_LISTEN"].split(",")
    unix = [u for u in listen if u.startswith("unix://")]
    assert len(unix) == 1 and any(unix[0].startswith(f"unix://{t}/") for t in target.values()), (
        "the broker's socket lives on a volume workers can mount"
    )
    for name, svc in services.items():
        assert svc["ipc"] == "service:broker", f"{name} cannot map the broker's /dev/shm"
        assert svc["pid"] == "service:broker", f"the broker cannot see {name}'s pids"
        assert set(svc["volumes"]) & set(broker["volumes"]), f"{name} lacks the socket volume"
        assert svc["environment"][ENV_URL] == unix[0]
        assert svc["depends_on"]["broker"]["condition"] == "service_healthy"
        assert svc["image"] == broker["image"] and svc["build"] == broker["build"], (
            "workers run the broker's image, so they have its uid"
        )
        assert "shm_size" not in svc, "a worker's /dev/shm is the broker's"


def test_shm_size_holds_max_memory_and_healthcheck_uses_the_cli() -> None:
    broker = load(DOCKER / "compose.yaml", {})["services"]["broker"]
    env = broker["environment"]
    assert docker_size(broker["shm_size"]) >= parse_size(env["TENSORDEPOT_MAX_MEMORY"]) > 64 << 20
    test = broker["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "tensordepot" and test[2] in ("stat", "ls"), test
    assert env[ENV_URL] == env["TENSORDEPOT_LISTEN"].split(",")[0], "the CLI finds the socket"
    assert broker["stop_signal"] == "SIGTERM"
    assert broker["command"][:2] == ["tensordepot", "serve"]


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in COMPOSE_FILES])
def test_environment_names_are_real_settings(path: Path) -> None:
    """A misspelt TENSORDEPOT_* variable would be ignored silently."""
    known = {f"TENSORDEPOT_{f.upper()}" for f in Settings.model_fields} | {ENV_URL, ENV_TOKEN}
    for name, svc in load(path, OVERRIDE_ENV).get("services", {}).items():
        env = svc.get("environment", {})
        assert isinstance(env, dict), f"{path.name}/{name}: use the mapping form of environment"
        unknown = {k for k in env if k.startswith("TENSORDEPOT_")} - known
        assert not unknown, f"{path.name}/{name}: {unknown} are not settings"


def test_gpu_variant_reserves_nvidia_gpus_and_installs_cuda12() -> None:
    merged = merge(load(DOCKER / "compose.yaml", {}), load(DOCKER / "compose.gpu.yaml", {}))
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, svc in merged["services"].items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        extra = svc["build"]["args"]["EXTRAS"]
        assert extra == "cuda12", (name, extra)
        assert re.search(rf"^{extra} = \[", pyproject, re.MULTILINE), (name, extra)
        assert svc["build"]["context"] == ".." and svc["image"].endswith("cuda12")
    assert 'ARG EXTRAS=""' in (DOCKER / "Dockerfile").read_text()


@pytest.mark.parametrize("extras", ["cuda12", "cuda13", "flight,cuda13", ""])
def test_the_image_installs_the_extras_cupy_with_its_cuda_toolkit(extras: str) -> None:
    """The Dockerfile's install step, run by bash with pip replaced by echo:
    a GPU extra brings its cupy with the [ctk] extra (NVRTC), of the version
    the extra requires (14 or later: DLPack max_version, bfloat16)."""
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (step,) = [rest for word, rest in dockerfile() if word == "RUN" and "pip install" in rest]
    script = step.replace("pip install", "echo").replace("rm -rf /src", "true")
    out = subprocess.run(
        ["bash", "-c", script],
        env={"EXTRAS": extras, "PATH": os.defpath},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == ("/src" + (f"[{extras}]" if extras else ""))
    wanted = [r for extra in extras.split(",") if extra.startswith("cuda") for r in optional[extra]]
    assert len(wanted) == (1 if extras else 0), optional
    for req in wanted:
        m = re.fullmatch(r"(cupy-cuda1[23]x)>=(\d+)", req)
        assert m is not None and int(m[2]) >= 14, f"{req}: cupy 13 has no DLPack max_version"
        assert f"{m[1]}[ctk]" in out[1:], f"the image installs {out}: no NVRTC for {m[1]}"
    if not wanted:
        assert out == out[:1], "a CPU image installs no cupy"


def test_gpu_workers_share_the_brokers_pid_and_ipc_in_the_gpu_file_itself() -> None:
    """CUDA IPC needs them: the GPU file says so itself, not only through compose.yaml."""
    gpu = load(DOCKER / "compose.gpu.yaml", {})["services"]
    assert "broker" in gpu and len(gpu) > 1
    for name, svc in gpu.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" for d in devices), f"{name} does not reserve the GPUs"
        if name != "broker":
            assert (svc["ipc"], svc["pid"]) == ("service:broker", "service:broker"), name


def test_dockerfile_installs_every_package_folder_and_runs_serve() -> None:
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-dir]")[1].split("\n[")[0]
    folders = set(re.findall(r'^"tensordepot[\w.]*" = "([^"]+)"', section, re.MULTILINE))
    assert folders >= {"common", "cli", "client", "service", "shm"}, folders
    copied = copies()
    for dest, src in copied.items():
        assert src.exists(), f"COPY {src.relative_to(ROOT)} {dest}: no such file"
    sources = {str(src.relative_to(ROOT)) for src in copied.values()}
    # Nested folders (service/routers) come with their parent.
    missing = {f for f in folders if not any(f == s or f.startswith(s + "/") for s in sources)}
    assert not missing, f"the image would lack {missing}"
    cmd = [json.loads(rest) for word, rest in steps if word == "CMD"]
    broker = load(DOCKER / "compose.yaml", {})["services"]["broker"]
    assert cmd == [broker["command"]], "the image's default command is the compose broker's"
    assert ("USER", "depot") in steps, "the broker does not run as root"
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for name in sources:
        assert f"!{name}" in ignore or f"!{name}/" in ignore, f"{name} is excluded from the context"


# -- the same commands and environment, as processes ---------------------------------


class Container:
    """What a compose service would run, mapped onto this host."""

    def __init__(
        self, service: dict[str, Any], paths: dict[str, str], launcher: list[str] | None = None
    ) -> None:
        self.paths = paths
        self.launcher = launcher or []  # runs it on another "host" (tests/_hosts.py)
        env = {k: self.host(str(v)) for k, v in service.get("environment", {}).items()}
        # Only the compose file's TENSORDEPOT_* variables, none of this shell's.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")} | env
        self.command = self.argv(service["command"])

    def host(self, text: str) -> str:
        for inside, outside in self.paths.items():
            text = text.replace(inside, outside)
        return text

    def argv(self, command: list[str]) -> list[str]:
        exe, *args = command
        script = Path(sys.executable).with_name(exe)
        if exe == "python":
            head = [sys.executable]
        elif exe == "tensordepot" and not script.exists():
            head = [sys.executable, "-m", "tensordepot"]
        else:
            head = [str(script) if script.exists() else exe]
        return self.launcher + head + [self.host(a) for a in args]

    def run(
        self, command: list[str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(command) if command else self.command,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert m, text
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tdc-", dir="/tmp")  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def host_paths(broker_svc: dict[str, Any], run_dir: str) -> dict[str, str]:
    """The socket volume becomes a fresh directory (the broker creates its
    socket in it, as in the container); copied files are the repo's own."""
    volume_target = broker_svc["volumes"][0].split(":")[1]
    paths = {volume_target: os.path.join(run_dir, "run")}
    return paths | {dest: str(src) for dest, src in copies().items() if src.is_file()}


@contextlib.contextmanager
def healthy_broker(
    broker: Container, broker_svc: dict[str, Any], run_dir: str
) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """Run the broker's command until its compose healthcheck passes; yield
    (process, socket path, log path).  Whatever is left is killed and swept."""
    settings = Settings(
        listen=broker.env["TENSORDEPOT_LISTEN"].split(","),
        shm_prefix=broker.env.get("TENSORDEPOT_SHM_PREFIX", ""),
    )
    prefix = settings.prefix()
    sock = settings.listen_urls()[0].removeprefix("unix://")
    assert sock.startswith(run_dir), sock
    log_path = os.path.join(run_dir, "broker.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            broker.command, env=broker.env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir
        )
    try:

        def healthy() -> bool:
            assert proc.poll() is None, Path(log_path).read_text()
            check = broker_svc["healthcheck"]
            return (
                broker.run(check["test"][1:], timeout=seconds(check["timeout"]) + 30).returncode
                == 0
            )

        wait_for(
            healthy,
            seconds(broker_svc["healthcheck"]["start_period"]) + 30,
            interval=0.2,
            what="the compose healthcheck to pass",
        )
        yield proc, sock, log_path
        assert shm_entries(prefix) == [], "SIGTERM must unlink every segment"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for entry in shm_entries(prefix):
            os.unlink(os.path.join("/dev/shm", entry))


def stop(proc: subprocess.Popen[bytes], broker_svc: dict[str, Any], log_path: str) -> None:
    """docker stop: the stop signal, then the grace period."""
    proc.send_signal(getattr(signal, broker_svc["stop_signal"]))
    assert proc.wait(seconds(broker_svc["stop_grace_period"])) == 0, Path(log_path).read_text()


def test_compose_commands_run_as_processes(run_dir: str) -> None:
    compose = load(DOCKER / "compose.yaml", {})
    broker_svc = compose["services"]["broker"]
    paths = host_paths(broker_svc, run_dir)
    broker = Container(broker_svc, paths)
    with healthy_broker(broker, broker_svc, run_dir) as (proc, sock, log_path):
        assert os.stat(sock).st_mode & 0o777 == 0o600

        workers = {n: s for n, s in compose["services"].items() if n != "broker"}
        for name, svc in workers.items():
            res = Container(svc, paths).run()
            assert res.returncode == 0, f"{name}: {res.stdout}\n{res.stderr}"
            assert ": ok" in res.stdout, res.stdout
        listed = broker.run(["tensordepot", "ls", "--json"])
        assert listed.returncode == 0, listed.stderr
        names = [i["name"] for i in json.loads(listed.stdout)]
        assert names == ["example/weights"], names
        stat = json.loads(broker.run(["tensordepot", "stat", "--json"]).stdout)
        assert stat["leases"] == 0 and stat["bytes_in_use"] >= 4 << 20, stat
        stop(proc, broker_svc, log_path)
        assert not os.path.exists(sock)


# -- two hosts (compose.hosts.yaml) -------------------------------------------------------


def _owner(svc: dict[str, Any]) -> str:
    [owner] = svc["depends_on"]
    return str(owner)


def test_two_hosts_workers_join_their_own_broker_and_b_pulls_from_a() -> None:
    services = load(HOSTS, OVERRIDE_ENV)["services"]
    brokers = {n: s for n, s in services.items() if s["command"][:2] == ["tensordepot", "serve"]}
    assert set(brokers) == {"broker-a", "broker-b"}
    assert set(brokers["broker-a"]["volumes"]).isdisjoint(brokers["broker-b"]["volumes"])
    for name, svc in services.items():
        assert svc["build"]["args"]["EXTRAS"] == "flight", f"{name} lacks pyarrow"
        if name in brokers:
            assert svc["ipc"] == "shareable" and svc["environment"]["TENSORDEPOT_TOKEN"]
            continue
        owner = _owner(svc)
        assert svc["ipc"] == svc["pid"] == f"service:{owner}", (
            f"{name} must share {owner}'s namespaces"
        )
        assert set(svc["volumes"]) == set(brokers[owner]["volumes"]), (
            f"{name} lacks {owner}'s socket"
        )
        assert svc["environment"][ENV_URL] == brokers[owner]["environment"]["TENSORDEPOT_LISTEN"]
    flight = urlsplit(brokers["broker-a"]["environment"]["TENSORDEPOT_FLIGHT"])
    peer = urlsplit(brokers["broker-b"]["environment"]["TENSORDEPOT_PEER"])
    assert (peer.scheme, peer.hostname, peer.port) == (flight.scheme, "broker-a", flight.port)
    assert _owner(brokers["broker-b"]) == "broker-a"
    assert re.search(r'^flight = \["pyarrow', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)


def _healthy(box: Container) -> bool:
    return box.run(["tensordepot", "stat"], timeout=60).returncode == 0


def test_two_hosts_commands_run_as_processes(tmp_path: Path) -> None:
    """Host B's broker and consumer run in a mount namespace with its own
    /dev/shm, so the consumer's tensor can only have come over Flight."""
    from _hosts import Host, why_no_hosts

    why = why_no_hosts()
    if why:
        pytest.skip(why)
    services = load(HOSTS, OVERRIDE_ENV)["services"]
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    flight = urlsplit(services["broker-a"]["environment"]["TENSORDEPOT_FLIGHT"])
    files = {dest: str(src) for dest, src in copies().items() if src.is_file()}
    net = {
        f"{flight.scheme}://{flight.netloc}": f"grpc://127.0.0.1:{port}",
        f"{flight.scheme}://broker-a:{flight.port}": f"grpc://127.0.0.1:{port}",
    }
    host_b = Host()
    procs: list[subprocess.Popen[bytes]] = []
    prefixes: dict[str, tuple[str, str]] = {}
    try:
        containers = {}
        for name, svc in services.items():
            run = str(tmp_path / f"run-{name[-1]}")  # one socket volume per host
            target = svc["volumes"][0].split(":")[1]
            containers[name] = Container(
                svc, {target: run, **files, **net}, host_b.launcher if name.endswith("-b") else None
            )
        for name in ("broker-a", "broker-b"):
            box = containers[name]
            settings = Settings(listen=box.env["TENSORDEPOT_LISTEN"].split(","))
            shm = host_b.shm_dir if name.endswith("-b") else "/dev/shm"
            prefixes[name] = (settings.prefix(), shm)
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        box.command, env=box.env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
                    )
                )
            wait_for(
                functools.partial(_healthy, box),
                90,
                interval=0.2,
                what=f"{name} to pass its healthcheck",
            )
        for name in ("producer-a", "consumer-b"):
            res = containers[name].run()
            assert res.returncode == 0, f"{name}: {res.stdout}\n{res.stderr}"
            assert ": ok" in res.stdout, res.stdout
        assert f"from grpc://127.0.0.1:{port} (v1 there)" in res.stdout, res.stdout
        listed = json.loads(containers["broker-b"].run(["tensordepot", "ls", "--json"]).stdout)
        assert [(i["name"], i["origin_version"]) for i in listed] == [("example/weights", 1)]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        for name, (prefix, shm) in prefixes.items():
            assert shm_entries(prefix, shm) == [], f"{name} left segments"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for prefix, shm in prefixes.values():
            for entry in shm_entries(prefix, shm):
                os.unlink(os.path.join(shm, entry))
        host_b.close()


def test_the_tcp_override_needs_its_token(run_dir: str) -> None:
    """compose.tcp.yaml: TCP clients need $TENSORDEPOT_TOKEN, and the broker refuses to
    start without it."""
    merged = merge(
        load(DOCKER / "compose.yaml", OVERRIDE_ENV), load(DOCKER / "compose.tcp.yaml", OVERRIDE_ENV)
    )
    broker_svc = merged["services"]["broker"]
    broker = Container(broker_svc, host_paths(broker_svc, run_dir))
    port = free_port()
    listen = broker.env["TENSORDEPOT_LISTEN"]
    assert listen.endswith(":7420"), listen  # the container port; on the host, a free one
    broker.env["TENSORDEPOT_LISTEN"] = listen.removesuffix(":7420") + f":{port}"
    tcp = f"http://127.0.0.1:{port}"

    tokenless = {k: v for k, v in broker.env.items() if k != ENV_TOKEN}
    res = subprocess.run(
        broker.command, env=tokenless, capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 1 and "needs a token" in res.stderr, res.stderr

    with healthy_broker(broker, broker_svc, run_dir) as (proc, _, log_path):
        # The CLI reads $TENSORDEPOT_TOKEN, which the compose file sets.
        assert broker.run(["tensordepot", "stat", "--url", tcp]).returncode == 0
        wrong = f"from tensordepot import Client; Client({tcp!r}, token='x' * 20)"
        anonymous = broker.run(["python", "-c", wrong])
        assert anonymous.returncode == 1, anonymous.stderr
        assert "AuthError: missing or wrong token" in anonymous.stderr, anonymous.stderr
        stop(proc, broker_svc, log_path)
