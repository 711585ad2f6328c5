"""Deterministic tensors that producer and consumer workers agree on."""

from __future__ import annotations

import numpy as np


def expected() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    base = rng.standard_normal((64, 48))
    return {
        "f32": base.astype(np.float32),
        "f64": rng.standard_normal((3, 5, 7)),
        "i64": rng.integers(-(2**62), 2**62, size=(1000,), dtype=np.int64),
        "bool": rng.random((17, 3)) > 0.5,
        "f16": rng.standard_normal((256,)).astype(np.float16),
        # Non-contiguous: every other column of a uint8 matrix (64 KiB+, so it takes the alloc
        # path).
        "u8_strided": rng.integers(0, 256, size=(600, 400), dtype=np.uint8)[:, ::2],
        "big_f32": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB: alloc + publish
        "filled": np.arange(4096, dtype=np.float32).reshape(64, 64) * 0.5,  # written via empty()
    }
