"""safetensors files in and out, against a real broker: ``tensordepot load``
and ``save`` and both clients' ``load_file`` / ``save_file`` round-trip a file
bit-exact (bfloat16 and float8 included, metadata kept), checked against the
safetensors library's own reader and writer; a file it cannot read says why
and puts nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _both import Api
from _harness import BrokerProc, cli, ok
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensordepot import InvalidRequest, OutOfMemory

META = {"format": "pt", "origin": "a test"}


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(32, 32, generator=g),
        "layers.0.b": torch.randn(32, generator=g, dtype=torch.float64),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "half": torch.randn(3, 5, generator=g).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k  # bit-exact


def test_the_cli_loads_and_saves_a_file_bit_exact(broker: BrokerProc, tmp_path: Path) -> None:
    src, out = tmp_path / "model.safetensors", tmp_path / "out.safetensors"
    sd = model()
    save_file(sd, str(src), metadata=META)
    said = ok("load", str(src), "--prefix", "llama/", "--url", broker.url)
    assert said == f"{len(sd)} tensors and its metadata from {src}\n"
    with broker.client() as c:
        names = sorted(i.name for i in c.list(prefix="llama/"))
        assert names == sorted([f"llama/{k}" for k in sd] + ["llama/__metadata__"])
        got = c.get_many([f"llama/{k}" for k in sd])
        same(sd, {k: torch.from_dlpack(got[f"llama/{k}"]) for k in sd})
        del got
    ok("save", "llama/", str(out), "--url", broker.url)
    same(sd, load_file(str(out)))
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == META
    with broker.client() as c:
        assert len(c.delete(prefix="llama/")) == len(sd) + 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_round_trip_with_progress(
    broker: BrokerProc, tmp_path: Path, kind: str
) -> None:
    api = Api(broker.url, kind)
    try:
        sd = {
            "big": torch.arange(80 << 20, dtype=torch.int32).to(torch.bfloat16),  # 160 MiB
            "w": torch.ones(3, dtype=torch.bfloat16),
        }
        save_file(sd, str(tmp_path / "in.safetensors"))
        heard: list[tuple[int, int]] = []
        versions = api.load_file(
            tmp_path / "in.safetensors", "m/", progress=lambda d, t: heard.append((d, t))
        )
        assert versions == {"m/big": 1, "m/w": 1}  # no metadata in the file: none kept
        total = sum(t.numel() * 2 for t in sd.values())
        assert heard and heard[-1] == (total, total), heard
        assert api.save_file("m/", tmp_path / "back.safetensors") == total
        same(sd, load_file(str(tmp_path / "back.safetensors")))
        with pytest.raises(InvalidRequest, match="no published tensor name starts with 'x/'"):
            api.save_file("x/", tmp_path / "none.safetensors")
        assert not (tmp_path / "none.safetensors").exists()
        assert api.delete(prefix="m/") == ["m/big", "m/w"]
    finally:
        api.close()


def _file(path: Path, header: Any, body: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + body)
    return path


@pytest.mark.parametrize(
    ("header", "body", "length", "says"),
    [
        (b"", b"", 0, "its header is not JSON"),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            None,
            "data_offsets [0, 8]",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "spans 8 bytes",
        ),
        (
            {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
            b"\0",
            None,
            "has dtype 'F4'",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            10**9,
            "its header claims",
        ),
        ([1, 2], b"", None, "not a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", None, "not a map of strings"),
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None, "nests too deeply"),
        (
            {"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "has dtype \"['F32']\"",
        ),
        (
            {"a": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "has dtype \"{'F32': 1}\"",
        ),
        (
            {"a": {"dtype": "U8", "shape": [1] * 40, "data_offsets": [0, 1]}},
            b"\0",
            None,
            "at most 32 dimensions",
        ),
    ],
)
def test_a_file_it_cannot_read_says_why_and_puts_nothing(
    broker: BrokerProc, tmp_path: Path, header: Any, body: bytes, length: int | None, says: str
) -> None:
    bad = _file(tmp_path / "bad.safetensors", header, body, length)
    res = cli("load", str(bad), "--url", broker.url)
    assert res.returncode == 1 and says in res.stderr, res.stderr
    assert "is not a safetensors file tensordepot can read" in res.stderr
    assert "Traceback" not in res.stderr
    with broker.client() as c:
        assert c.list() == []
        with pytest.raises(InvalidRequest, match="cannot read"):
            c.load_file(tmp_path / "missing.safetensors")


def test_a_save_never_writes_through_a_planted_temporary_file(
    broker: BrokerProc, tmp_path: Path
) -> None:
    """In a shared directory another user can plant a symlink where a save's
    temporary file would go (``<path>.tmp-<pid>`` was guessable): the save
    must create its own, and the file the link points to stays as it was."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root only")
    out = tmp_path / "out.safetensors"
    planted = {Path(f"{out}.tmp-{pid}") for pid in (os.getpid(), *range(1, 64))}
    for p in planted:
        p.symlink_to(victim)
    sd = {"w": torch.arange(6.0)}
    with broker.client() as c:
        c.put_many({f"s/{k}": v for k, v in sd.items()})
        assert c.save_file("s/", out) == 24
        ok("save", "s/", str(tmp_path / "cli.safetensors"), "--url", broker.url)
        c.delete(prefix="s/")
    assert victim.read_bytes() == b"root only"
    same(sd, load_file(str(out)))
    same(sd, load_file(str(tmp_path / "cli.safetensors")))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    assert set(tmp_path.iterdir()) == {victim, out, tmp_path / "cli.safetensors", *planted}


_SHRINKER = """
import os, sys
from tensordepot import Client, InvalidRequest
url, path = sys.argv[1:]
def progress(done, total):
    if done < total:
        os.truncate(path, 1 << 20)  # another process shortens the file mid-copy
with Client(url) as c:
    try:
        c.load_file(path, "f/", progress=progress)
    except InvalidRequest as exc:
        print("refused:", exc)
    print("listed", len(c.list()))
"""


def test_a_file_that_shrinks_while_it_is_loaded_is_refused_not_fatal(
    broker: BrokerProc, tmp_path: Path
) -> None:
    """Loading through a mapping, a file truncated mid-copy killed the loading
    process with SIGBUS; read, it is an error, and nothing is put."""
    path = tmp_path / "big.safetensors"
    mib = 1 << 20
    header = {
        f"t{i}": {
            "dtype": "U8",
            "shape": [300 * mib],
            "data_offsets": [i * 300 * mib, (i + 1) * 300 * mib],
        }
        for i in range(2)
    }
    _file(path, header)
    os.truncate(path, path.stat().st_size + 600 * mib)  # sparse: no disk written
    res = subprocess.run(
        [sys.executable, "-c", _SHRINKER, broker.url, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    assert "changed while it was read" in res.stdout and "listed 0" in res.stdout, res.stdout
    broker.check_clean()


def test_a_refused_load_says_what_the_broker_said(broker_factory: Any, tmp_path: Path) -> None:
    """A put the broker refuses (a quota) reaches the caller as that refusal,
    not as an error about the file's mapping, and the CLI prints one line."""
    b = broker_factory("--max-memory-per-session", "1MiB")
    path = tmp_path / "two.safetensors"
    save_file({"w": torch.zeros(1 << 20)}, str(path))  # 4 MiB
    with b.client() as c:
        with pytest.raises(OutOfMemory, match="--max-memory-per-session"):
            c.load_file(path, "m/")
        assert c.list() == []
    res = cli("load", str(path), "--url", b.url)
    assert res.returncode == 1 and "--max-memory-per-session" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "BufferError" not in res.stderr
    b.check_clean()


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        (np.frombuffer(b"\xff\xfe", np.uint8), "not JSON text"),
        (np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8), "nests too deeply"),
        (np.frombuffer(b'{"a": 1}', np.uint8), "not a map of strings"),
        (np.zeros(3, np.float32), "float32 tensor"),
    ],
)
def test_a_planted_metadata_tensor_is_refused_before_anything_is_written(
    broker: BrokerProc, tmp_path: Path, meta: Any, says: str
) -> None:
    out = tmp_path / "out.safetensors"
    with broker.client() as c:
        c.put_many({"p/w": np.arange(3.0), "p/__metadata__": meta})
        with pytest.raises(InvalidRequest, match=f"'p/__metadata__' is not .*{says}"):
            c.save_file("p/", out)
        c.delete(prefix="p/")
    assert list(tmp_path.iterdir()) == []
    broker.check_clean()
