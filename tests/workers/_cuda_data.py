"""Deterministic test tensors for the GPU tests: the same (dtype, n, seed)
gives the same bytes in every process."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "float64": torch.float64,
}


def expected(dtype: str, n: int, seed: int) -> Any:
    """A CPU tensor of ``n`` elements; floats include -0.0, inf and nan, so
    "bit-exact" means bits, not values."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    if dt.is_floating_point:
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 1000).to(dt)
        specials = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=dt)
        x[: min(n, 4)] = specials[: min(n, 4)]
        return x
    if dt == torch.int64:
        return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(dt)


def raw(t: Any) -> bytes:
    """The bytes of a torch tensor (any device, C order)."""
    return bytes(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
