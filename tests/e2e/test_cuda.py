"""CUDA code paths of a CPU broker: device sources are refused clearly, and
tensors read from the broker move to the GPU with ordinary framework calls.

These run only where a CUDA GPU is present (``@pytest.mark.cuda``)."""

from __future__ import annotations

import numpy as np
import pytest
from _harness import BrokerProc

pytestmark = pytest.mark.cuda
torch = pytest.importorskip("torch")

kDLCUDA = 2


def test_put_of_cuda_tensor_says_what_to_do(broker: BrokerProc) -> None:
    x = torch.arange(16, dtype=torch.float32, device="cuda")
    with broker.client() as c:
        with pytest.raises(BufferError, match=r"move it to the CPU first"):
            c.put("gpu", x)
        assert c.list() == [], "a refused put must leave nothing behind"
        assert c.stat().bytes_in_use == 0
        c.put("gpu", x.cpu())  # the advice works
        got = torch.from_dlpack(c.get("gpu"))
        assert torch.equal(got, x.cpu())
        del got


@pytest.mark.parametrize("dtype", [pytest.param(d, id=str(d).split(".")[-1]) for d in
                                   (torch.float32, torch.bfloat16, torch.float16, torch.int64)])
def test_broker_tensor_to_gpu_is_bit_exact(broker: BrokerProc, dtype: object) -> None:
    src = (torch.randn(257, 33) * 100).to(dtype)  # type: ignore[arg-type]
    with broker.client() as c:
        c.put("w", src)
        t = c.get("w")
        on_gpu = torch.from_dlpack(t).to("cuda", non_blocking=False)
        assert on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
        back = on_gpu.cpu()
        assert back.view(torch.uint8).numpy().tobytes() == src.view(torch.uint8).numpy().tobytes()
        del t, on_gpu, back


def test_export_to_cuda_device_is_refused(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("h", np.ones(8, dtype=np.float32))
        t = c.get("h")
        with pytest.raises(BufferError, match="cannot be exported to DLPack device"):
            t.__dlpack__(dl_device=(kDLCUDA, 0), max_version=(1, 0))
        del t


def test_cupy_reads_broker_tensor_after_upload(broker: BrokerProc) -> None:
    cupy = pytest.importorskip("cupy")
    if not cupy.is_available():
        pytest.skip("cupy cannot reach a GPU here")
    with broker.client() as c:
        c.put("c", np.arange(1000, dtype=np.float64))
        host = np.from_dlpack(c.get("c"))
        dev = cupy.asarray(host)
        assert float(dev.sum()) == float(np.arange(1000).sum())
        del host, dev
