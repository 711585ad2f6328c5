"""Issue: DLPack interop.  Producers x consumers x dtypes, through a real broker.

One producer process per library (numpy, torch) puts every dtype its library
has; then one consumer process reads each tensor through np.from_dlpack,
SharedTensor.numpy(), torch.from_dlpack and jax.dlpack.from_dlpack.  Each
cell must be bit-exact and zero-copy where the consumer has the dtype, and
must raise the consumer's own error otherwise; either way the broker's lease
count returns to zero.

The README's dtype x framework matrix is rendered from these results; run
``python tests/e2e/test_interop.py`` to rewrite it after a library changes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent))  # _harness, when run as a script
sys.path.append(str(Path(__file__).resolve().parent.parent / "workers"))  # interop_data
from _harness import ROOT, BrokerProc, run_worker
from interop_data import CONSUMERS, KINDS, PRODUCERS
from tensordepot.shm import DTYPES

README = ROOT / "README.md"
BEGIN, END = "<!-- dtype-matrix:begin -->", "<!-- dtype-matrix:end -->"


def producer_has(producer: str, dtype: str) -> bool:
    """Whether ``producer``'s library has ``dtype`` (numpy: built in or from ml_dtypes)."""
    d = DTYPES[dtype]
    if producer == "numpy":
        if d.numpy_name is not None:
            return True
        try:
            import ml_dtypes
        except ImportError:
            return False
        return hasattr(ml_dtypes, d.ml_dtypes_name or dtype)
    try:
        import torch
    except ImportError:
        return False
    return isinstance(getattr(torch, dtype, None), torch.dtype)


CELLS = [
    pytest.param(p, d, c, id=f"{p}-{d}-{c}")
    for p in PRODUCERS
    for d in DTYPES
    if producer_has(p, d)
    for c in CONSUMERS
]


@contextmanager
def matrix_run() -> Iterator[dict[str, Any]]:
    """Start a broker, run both producers and then the consumer; yield the results.

    On the way out the broker must have clean accounting, exit 0 on SIGTERM
    and leave nothing in /dev/shm."""
    b = BrokerProc()
    try:
        puts = {}
        for producer in PRODUCERS:
            res = run_worker("interop_producer", producer, b.url)
            puts[producer] = json.loads(res.stdout.splitlines()[-1])
        res = run_worker("interop_consumer", b.url, *PRODUCERS, timeout=300)
        out = json.loads(res.stdout.splitlines()[-1])
        out["puts"] = puts
        yield out
        b.check_clean()
        rc = b.stop()
        assert rc == 0, f"broker exited with {rc} after SIGTERM:\n{b.log()}"
        assert b.segments() == [], f"SIGTERM left segments in /dev/shm: {b.segments()}"
    finally:
        b.cleanup()


@pytest.fixture(scope="module")
def matrix() -> Iterator[dict[str, Any]]:
    with matrix_run() as out:
        yield out


@pytest.mark.parametrize("producer", PRODUCERS)
def test_producer_puts_every_dtype_it_has(matrix: dict[str, Any], producer: str) -> None:
    assert matrix["puts"][producer]["put"] == [d for d in DTYPES if producer_has(producer, d)]


def test_required_cells_are_in_the_matrix() -> None:
    ids = {p.id for p in CELLS}
    for cell in ("torch-bfloat16-torch", "torch-float8_e4m3fn-torch", "torch-bfloat16-jax"):
        assert cell in ids


@pytest.mark.parametrize("producer,dtype,consumer", CELLS)
def test_cell(matrix: dict[str, Any], producer: str, dtype: str, consumer: str) -> None:
    cell = matrix["cells"].get(f"{producer}-{dtype}-{consumer}")
    if cell is None:
        pytest.skip(f"{CONSUMERS[consumer]} is not installed")
    supported = dtype in matrix["has"][consumer]
    for kind in KINDS:
        r = cell[kind]
        where = f"{CONSUMERS[consumer]} of a {kind} {dtype} put from {producer}"
        assert r["meta"], f"{where}: the SharedTensor's dtype or shape is wrong"
        assert r["drained"], f"{where}: the lease was never released (leak)"
        if consumer != "jax":
            # jax 0.11 (seen on a GPU machine) keeps imported bfloat16/float8
            # buffers in a reference cycle of its own, so for jax the lease may
            # wait for a gc pass; "drained" above still catches a real leak.
            assert r["drained_without_gc"], (
                f"{where}: the lease was held until a gc pass (a reference cycle)"
            )
        if supported:
            assert r["ok"], f"{where} raised {r['error']}"
            assert r["bitexact"], f"{where}: the bytes differ"
            assert r["zero_copy"], (
                f"{where}: the consumer's data pointer is not the broker's memory"
            )
            if consumer.startswith("numpy"):
                assert r["read_only"], f"{where}: a published tensor is writable in numpy"
        else:
            assert not r["ok"], f"{where} imported a dtype the library does not have"
            etype, msg = r["error"]
            assert etype in ("BufferError", "RuntimeError", "TypeError", "ValueError"), r["error"]
            assert msg, r["error"]
            if cell.get("native_error") is not None:
                # The consumer's own error, unchanged: the same as for a jax array of the dtype.
                assert r["error"] == cell["native_error"], (r["error"], cell["native_error"])


def render(matrix: dict[str, Any]) -> str:
    """The README's dtype x framework table."""
    head = ["dtype", *(f"put from {p}" for p in PRODUCERS), *(f"`{c}`" for c in CONSUMERS.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype in DTYPES:
        row = [f"`{dtype}`"]
        row += ["yes" if dtype in matrix["puts"][p]["put"] else "—" for p in PRODUCERS]
        for consumer in CONSUMERS:
            results = [
                matrix["cells"][f"{p}-{dtype}-{consumer}"][kind]
                for p in PRODUCERS
                for kind in KINDS
                if f"{p}-{dtype}-{consumer}" in matrix["cells"]
            ]
            outcomes = {
                "yes" if r["ok"] and r["bitexact"] else f"raises {r['error'][0]}" for r in results
            }
            row.append(outcomes.pop() if len(outcomes) == 1 else "mixed" if outcomes else "not run")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def readme_section(text: str) -> str:
    assert BEGIN in text and END in text, f"README.md lacks the {BEGIN} ... {END} markers"
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def test_readme_matrix_matches(matrix: dict[str, Any]) -> None:
    assert matrix["versions"]["jax"], (
        "jax is not installed; the matrix needs it (pip install -e '.[test]')"
    )
    assert readme_section(README.read_text()) == render(matrix), (
        "README.md's dtype matrix is out of date; run `python tests/e2e/test_interop.py` to "
        "rewrite it"
    )


if __name__ == "__main__":
    with matrix_run() as out:
        table = render(out)
    text = README.read_text()
    readme_section(text)
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print(table)
