"""The client's handle check (client/_extent.py) on its own: what it refuses,
and that remembering the extents that passed never lets a bad one through.
The end-to-end cases (a broker that sends such handles) are in
tests/e2e/test_trust_handles.py."""

from __future__ import annotations

from typing import Any

import pytest
from tensordepot import TensorBroken
from tensordepot._wire import HandleColumns
from tensordepot.client._extent import check_columns, check_extent


@pytest.mark.parametrize("size,offset,nbytes,shape,strides,dtype,problem", [
    (4096, 0, 1024, [256], [1], "float32", None),
    (1000, 0, 1024, [256], [1], "float32", "not within its segment"),  # the segment is smaller
    (4096, 3500, 1024, [256], [1], "float32", "not within its segment"),  # it ends past the end
    (4096, -8, 1024, [256], [1], "float32", "not within its segment"),
    (4096, 0, 1024, [256], [2], "float32", "reach bytes"),  # twice the bytes it has
    (4096, 0, 1024, [256], [-1], "float32", "reach bytes"),  # before its first byte
    (4096, 0, 1024, [16, 16], [1, 16], "float32", None),  # transposed: the same bytes
    (4096, 0, 1024, [16, 16], [16, 2], "float32", "reach bytes"),
    (4096, 0, 1024, [16, 16], [16], "float32", "do not match its shape"),
    (4096, 0, 1024, [257], [1], "float32", "bytes, not its 1024"),
    (4096, 0, 1024, [-256], [1], "float32", "dimensions >= 0"),
    (4096, 0, 0, [0, 5], [5, 1], "float32", None),  # empty: nothing is reached
    (4096, 0, 1024, [256], [1], "float99", "dtype 'float99' is unknown"),
])
def test_the_check_refuses_what_reaches_outside_and_remembers_only_what_passed(
        size: int, offset: int, nbytes: int, shape: list[int], strides: list[int], dtype: str,
        problem: str | None) -> None:
    for _ in range(2):  # the second time the same numbers meet the remembered answer
        if problem is None:
            assert check_extent("t", size, offset, nbytes, shape, strides, dtype).name == dtype
        else:
            with pytest.raises(TensorBroken, match=problem):
                check_extent("t", size, offset, nbytes, shape, strides, dtype)


def test_a_passed_extent_in_a_smaller_segment_is_refused() -> None:
    """The segment's size is part of what is remembered."""
    assert check_extent("t", 8192, 4096, 4096, [1024], None, "float32").itemsize == 4
    with pytest.raises(TensorBroken, match="not within its segment of 4096 bytes"):
        check_extent("t", 4096, 4096, 4096, [1024], None, "float32")


def test_a_put_gets_the_shape_and_dtype_it_asked_for_even_after_a_pass() -> None:
    assert check_extent("t", 4096, 0, 64, [16], None, "float32", ((16,), "float32"))
    with pytest.raises(TensorBroken, match="asked for"):
        check_extent("t", 4096, 0, 64, [16], None, "float32", ((4, 4), "float32"))


def _cols(segment: list[int], others: dict[int, object] | None = None) -> HandleColumns:
    n = len(segment)
    return HandleColumns.model_construct(
        names=[f"t{i}" for i in range(n)], versions=[1] * n, segment=segment,
        segments=["td-a", "td-b"], offsets=[0] * n, nbytes=[4] * n, shapes=[[1]] * n,
        dtypes=["float32"] * n, leases=None, others=others or {})


@pytest.mark.parametrize("segment,others,ok", [
    ([0, 1, 0], None, True),
    ([], None, True),
    ([0, 2], None, False),  # there are two segments
    ([0, -1], None, False),  # -1 says "in others", and others is empty
    ([0, -1], {1: object()}, True),
    ([0, 1], {1: object()}, False),  # in others and in a segment
])
def test_batch_columns_name_segments_of_the_batch(segment: list[int], others: Any,
                                                   ok: bool) -> None:
    cols = _cols(segment, others)
    if ok:
        check_columns(cols)
    else:
        with pytest.raises(TensorBroken):
            check_columns(cols)
