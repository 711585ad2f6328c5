"""The CUDA parts of the wire format: IPC handles as text, handles and stats
through JSON and back, and what the models refuse."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from pydantic import ValidationError
from tensordepot._wire import (
    IPC_HANDLE_BYTES,
    CudaHandle,
    DeviceStat,
    Handle,
    LiveReply,
    ShareRequest,
    Stat,
    decode_ipc,
    encode_ipc,
)

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
EDGES = [
    pytest.param(bytes(64), id="zeros"),
    pytest.param(b"\xff" * 64, id="ones"),
    pytest.param(b"\x00" * 63 + b"\x01", id="trailing-one"),
    pytest.param(os.urandom(64), id="random"),
]


@pytest.mark.parametrize("raw", EDGES)
def test_ipc_handles_round_trip_exactly(raw: bytes) -> None:
    text = encode_ipc(raw)
    assert len(text) == 88 and text.isascii()
    assert decode_ipc(text) == raw


@pytest.mark.parametrize(
    "text", ["", "AAAA", "A" * 88, "=" * 88, "é" * 88, encode_ipc(bytes(64))[:-4]]
)
def test_what_is_not_a_handle_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="CUDA IPC handle"):
        decode_ipc(text)


def test_encode_checks_the_size() -> None:
    with pytest.raises(ValueError, match=str(IPC_HANDLE_BYTES)):
        encode_ipc(bytes(65))


def cuda_handle(**kw: Any) -> CudaHandle:
    fields: dict[str, Any] = {
        "uuid": UUID,
        "ipc_handle": encode_ipc(os.urandom(64)),
        "block_size": 1 << 28,
        "event": 7,
        "event_handle": encode_ipc(os.urandom(64)),
        "release_event": 9,
        "release_event_handle": encode_ipc(bytes(64)),
    }
    return CudaHandle(**{**fields, **kw})


def handle(cuda: CudaHandle | None) -> Handle:
    return Handle(
        name="w",
        version=3,
        kind="cuda" if cuda else "posix",
        segment="seg",
        offset=512,
        nbytes=4096,
        shape=[32, 32],
        strides=[32, 1],
        dtype="float32",
        device=f"cuda:{UUID}" if cuda else "cpu",
        state="ready",
        lease=11,
        cuda=cuda,
    )


@pytest.mark.parametrize(
    "owner",
    [
        pytest.param({}, id="broker-block"),
        pytest.param({"owner_pid": 4242, "owner_start": 987654}, id="share"),
    ],
)
def test_a_cuda_handle_crosses_json_unchanged(owner: dict[str, int]) -> None:
    h = handle(cuda_handle(**owner))
    for again in (
        Handle.model_validate_json(h.model_dump_json()),  # the broker's bytes
        Handle.model_validate(json.loads(h.model_dump_json())),
    ):  # the client's reading
        assert again == h
        assert again.cuda is not None and h.cuda is not None
        for field in ("ipc_handle", "event_handle", "release_event_handle"):
            assert decode_ipc(getattr(again.cuda, field)) == decode_ipc(getattr(h.cuda, field))
        assert (again.offset, again.cuda.block_size) == (512, 1 << 28)


def test_a_cpu_handle_has_no_cuda_part() -> None:
    h = handle(None)
    assert Handle.model_validate_json(h.model_dump_json()).cuda is None
    old = json.loads(h.model_dump_json())
    del old["cuda"]  # a handle from a broker that predates CUDA still reads
    assert Handle.model_validate(old) == h


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"uuid": "GPU-1234"}, id="short-uuid"),
        pytest.param({"uuid": UUID.upper()}, id="uppercase-uuid"),
        pytest.param({"uuid": "0"}, id="ordinal"),
        pytest.param({"ipc_handle": "A" * 87}, id="short-handle"),
        pytest.param({"event_handle": "not base64" + "A" * 78}, id="junk-event"),
        pytest.param({"block_size": -1}, id="negative-size"),
    ],
)
def test_cuda_handle_refuses_what_no_process_could_open(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        cuda_handle(**bad)


def test_share_request_validates_its_handle_and_sizes() -> None:
    good = {
        "name": "w",
        "shape": [4],
        "dtype": "float32",
        "device": f"cuda:{UUID}",
        "ipc_handle": encode_ipc(os.urandom(64)),
        "offset": 0,
        "alloc_size": 16,
    }
    assert ShareRequest.model_validate(good).alloc_size == 16
    for bad in ({"ipc_handle": "x"}, {"offset": -1}, {"alloc_size": 0}, {"name": ""}):
        with pytest.raises(ValidationError):
            ShareRequest.model_validate({**good, **bad})


def test_stat_lists_gpus_and_reads_without_them() -> None:
    dev = DeviceStat(
        device=f"cuda:{UUID}",
        bytes_in_use=1,
        bytes_reserved=2,
        bytes_pending=0,
        bytes_shared=0,
        max_memory=3,
        segments=1,
        events=2,
        context_bytes=None,
    )
    base = {
        "bytes_in_use": 1,
        "bytes_reserved": 2,
        "max_memory": 3,
        "tensors": 1,
        "versions": 1,
        "leases": 0,
        "sessions": 1,
        "segments": 1,
    }
    st = Stat(**base, devices=[dev])
    assert Stat.model_validate_json(st.model_dump_json()) == st
    assert Stat.model_validate(base).devices == [], "a CPU-only broker lists no GPU"
    assert LiveReply.model_validate({"live": [], "busy": []}).orphaned == []


def test_cuda_handle_ignores_fields_a_newer_broker_adds() -> None:
    """Answers parse leniently: a client keeps working with a newer broker."""
    h = cuda_handle(surprise=1)
    assert not hasattr(h, "surprise")
