"""Device names and the UUID <-> ordinal mapping, without a GPU.

The mapping is what lets two processes that number their GPUs differently
(their own CUDA_VISIBLE_DEVICES) agree on which GPU a handle names.  Here
the driver's enumeration is a list of UUIDs; ``tests/e2e/test_cuda.py``
checks the same rules against a real driver.
"""

from __future__ import annotations

import pytest
from tensordepot.shm._device import (
    CPU,
    Device,
    DeviceError,
    DeviceMap,
    format_uuid,
    normalize_uuid,
    parse_device,
    uuid_key,
    visible_devices,
)

U0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
U1 = "GPU-8932f937-0000-4106-c12f-20bd9faed9f7"  # shares U0's first 8 hex digits
U2 = "GPU-1b2c3d4e-aaaa-bbbb-cccc-000000000002"
MIG = "MIG-0f0e0d0c-1111-2222-3333-444455556666"
PHYSICAL = [U0, U1, U2]


# -- names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [
        pytest.param("cpu", CPU, id="cpu"),
        pytest.param("cpu:0", CPU, id="cpu:0"),
        pytest.param(" CPU ", CPU, id="CPU-spaced"),
        pytest.param("cuda", Device("cuda"), id="cuda"),
        pytest.param("cuda:0", Device("cuda", ordinal=0), id="cuda:0"),
        pytest.param("cuda:12", Device("cuda", ordinal=12), id="cuda:12"),
        pytest.param(f"cuda:{U0}", Device("cuda", uuid=U0), id="uuid"),
        pytest.param(f"cuda:{U0.upper()}", Device("cuda", uuid=U0), id="uuid-upper"),
        pytest.param(f"cuda:gpu-{U0[4:]}", Device("cuda", uuid=U0), id="uuid-lower-prefix"),
        pytest.param(f"cuda:{MIG}", Device("cuda", uuid=MIG), id="mig"),
    ],
)
def test_device_names_parse(text: str, want: Device) -> None:
    got = parse_device(text)
    assert got == want
    assert parse_device(str(got)) == got, "a parsed name prints as a name that parses the same"


class TorchLikeDevice:
    def __init__(self, type: str, index: int | None) -> None:
        self.type, self.index = type, index


@pytest.mark.parametrize(
    "dev,want",
    [
        pytest.param(TorchLikeDevice("cuda", 1), Device("cuda", ordinal=1), id="cuda-1"),
        pytest.param(TorchLikeDevice("cuda", None), Device("cuda"), id="cuda"),
        pytest.param(TorchLikeDevice("cpu", None), CPU, id="cpu"),
    ],
)
def test_device_objects_parse(dev: object, want: Device) -> None:
    assert parse_device(dev) == want


@pytest.mark.parametrize(
    "text",
    [
        "",
        "gpu",
        "cuda:",
        "cuda:-1",
        "cuda: 1",
        "cuda:1.0",
        "cuda:0x1",
        "cuda0",
        "cuda:GPU-1234",
        f"cuda:{U0}0",
        "cuda:GPU-zzzzzzzz-d72c-4106-c12f-20bd9faed9f6",
        f"cuda:XPU-{U0[4:]}",
        "cpu:1",
        "mps",
        "cuda:\u0661",  # an Arabic-Indic one: not an ordinal
    ],
)
def test_bad_device_names_say_what_is_allowed(text: str) -> None:
    with pytest.raises(DeviceError, match=r"cuda:N|device UUID"):
        parse_device(text)


@pytest.mark.parametrize("obj", [None, 0, 1.5, TorchLikeDevice("mps", 0)])
def test_bad_device_objects_are_refused(obj: object) -> None:
    with pytest.raises(DeviceError):
        parse_device(obj)


def test_device_error_is_a_value_error() -> None:
    assert issubclass(DeviceError, ValueError)


def test_uuid_bytes_format_like_nvidia_smi_zero_bytes_included() -> None:
    raw = bytes.fromhex("8932f937d72c4106c12f20bd9faed9f6")
    assert format_uuid(raw) == U0
    zeros = bytes(16)  # a C-string conversion would lose everything after the first zero
    assert format_uuid(zeros) == "GPU-00000000-0000-0000-0000-000000000000"
    assert format_uuid(b"\x01" + bytes(15), "MIG").startswith("MIG-01000000-")
    with pytest.raises(ValueError):
        format_uuid(bytes(15))


def test_gpu_and_mig_spellings_name_the_same_device() -> None:
    assert uuid_key(U0) == uuid_key("MIG-" + U0[4:]) == uuid_key(U0.upper())
    assert normalize_uuid(U0.upper()) == U0
    with pytest.raises(DeviceError):
        normalize_uuid("GPU-8932f937")


# -- CUDA_VISIBLE_DEVICES ------------------------------------------------------------------


@pytest.mark.parametrize(
    "env,want",
    [
        pytest.param(None, PHYSICAL, id="unset"),
        pytest.param("", [], id="empty-hides-all"),
        pytest.param("0", [U0], id="0"),
        pytest.param("2,0", [U2, U0], id="reordered"),
        pytest.param(" 1 , 2 ", [U1, U2], id="spaces"),
        pytest.param("0,2,-1,1", [U0, U2], id="stops-at-negative"),
        pytest.param("3", [], id="out-of-range"),
        pytest.param("1,7,0", [U1], id="stops-at-out-of-range"),
        pytest.param("0,0", [U0], id="repeat-stops"),
        pytest.param("x,0", [], id="junk-first"),
        pytest.param("\u0661", [], id="non-ascii-digit"),
        pytest.param(U2, [U2], id="uuid"),
        pytest.param(f"{U2},{U0}", [U2, U0], id="uuid-list"),
        pytest.param("GPU-1b2c3d4e", [U2], id="uuid-prefix"),
        pytest.param("GPU-8932f937", [], id="ambiguous-prefix"),
        pytest.param("GPU-8932f937-d", [U0], id="long-enough-prefix"),
        pytest.param(f"1,{U0.upper()}", [U1, U0], id="index-and-uuid"),
        pytest.param("GPU-", [], id="empty-prefix"),
        pytest.param(f"MIG-{U0[4:]}", [], id="mig-name-of-a-gpu"),
    ],
)
def test_visible_devices_follow_cudas_rules(env: str | None, want: list[str]) -> None:
    assert visible_devices(env, PHYSICAL) == want


def test_visible_devices_with_a_mig_device() -> None:
    physical = [U0, MIG, U2]
    assert visible_devices(MIG, physical) == [MIG]
    assert visible_devices("MIG-0f0e", physical) == [MIG]
    assert visible_devices(f"{MIG},0", physical) == [MIG, U0]
    assert visible_devices("GPU-0f0e", physical) == [], "a MIG device is not named GPU-"


# -- the mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "broker_env,worker_env",
    [
        pytest.param(None, None, id="both-unset"),
        pytest.param("2,1,0", None, id="reversed-vs-unset"),
        pytest.param(f"{U1},{U2}", "2,1", id="uuids-vs-indices"),
        pytest.param("1", f"{U1}", id="one-gpu-by-index-and-by-uuid"),
    ],
)
def test_processes_that_number_gpus_differently_agree_by_uuid(
    broker_env: str | None, worker_env: str | None
) -> None:
    broker = DeviceMap.for_environment(broker_env, PHYSICAL)
    worker = DeviceMap.for_environment(worker_env, PHYSICAL)
    for ordinal, uuid in enumerate(broker.uuids):
        if uuid not in worker.uuids:
            continue
        local = worker.ordinal(uuid)  # what a handle naming the broker's GPU means here
        assert worker.uuid(local) == broker.uuid(ordinal) == uuid
    both = set(broker.uuids) & set(worker.uuids)
    assert both, "the cases above share at least one GPU"


def test_reversed_order_maps_ordinals_crosswise() -> None:
    broker = DeviceMap.for_environment("1,0", PHYSICAL)
    worker = DeviceMap.for_environment(None, PHYSICAL)
    assert broker.uuid(0) == U1
    assert worker.ordinal(broker.uuid(0)) == 1
    assert worker.ordinal(broker.uuid(1)) == 0


def test_a_hidden_gpu_is_an_error_that_names_the_variable() -> None:
    worker = DeviceMap.for_environment("0", PHYSICAL)
    with pytest.raises(DeviceError, match=r"not visible in this process.*CUDA_VISIBLE_DEVICES '0'"):
        worker.ordinal(U2)
    with pytest.raises(DeviceError, match="does not exist"):
        worker.uuid(1)
    with pytest.raises(DeviceError, match="no GPU"):
        DeviceMap.for_environment("", PHYSICAL).ordinal(U0)


def test_mig_spelling_finds_the_device_the_driver_calls_gpu() -> None:
    m = DeviceMap([U0])  # the driver's bytes, spelt GPU-
    assert m.ordinal("MIG-" + U0[4:]) == 0


def test_resolve_plain_cuda_ordinals_and_uuids() -> None:
    m = DeviceMap.for_environment("2,0", PHYSICAL)
    assert m.resolve(Device("cuda"), current=1) == (1, U0)
    assert m.resolve(parse_device("cuda:0")) == (0, U2)
    assert m.resolve(parse_device(f"cuda:{U0}")) == (1, U0)
    with pytest.raises(DeviceError):
        m.resolve(parse_device("cuda:2"))
    with pytest.raises(DeviceError):
        m.resolve(CPU)
