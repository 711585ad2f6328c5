"""The client's handle check (client/_extent.py) on its own: what it refuses,
and that remembering the extents that passed never lets a bad one through.
The end-to-end cases (a broker that sends such handles) are in
tests/e2e/test_trust_handles.py."""

from __future__ import annotations

from typing import Any

import pytest
from tensordepot import TensorBroken
from tensordepot._wire import HandleColumns
from tensordepot.client._extent import (
    check_allocations,
    check_columns,
    check_extent,
    check_segment,
)


@pytest.mark.parametrize(
    "size,offset,nbytes,shape,strides,dtype,problem",
    [
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
    ],
)
def test_the_check_refuses_what_reaches_outside_and_remembers_only_what_passed(
    size: int,
    offset: int,
    nbytes: int,
    shape: list[int],
    strides: list[int],
    dtype: str,
    problem: str | None,
) -> None:
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
        names=[f"t{i}" for i in range(n)],
        versions=[1] * n,
        segment=segment,
        segments=["td-a", "td-b"],
        offsets=[0] * n,
        nbytes=[4] * n,
        shapes=[[1]] * n,
        dtypes=["float32"] * n,
        leases=None,
        others=others or {},
    )


@pytest.mark.parametrize(
    "segment,others,ok",
    [
        ([0, 1, 0], None, True),
        ([], None, True),
        ([0, 2], None, False),  # there are two segments
        ([0, -1], None, False),  # -1 says "in others", and others is empty
        ([0, -1], {1: object()}, True),
        ([0, 1], {1: object()}, False),  # in others and in a segment
    ],
)
def test_batch_columns_name_segments_of_the_batch(
    segment: list[int], others: Any, ok: bool
) -> None:
    cols = _cols(segment, others)
    if ok:
        check_columns(cols)
    else:
        with pytest.raises(TensorBroken):
            check_columns(cols)


def _allocated(**change: Any) -> HandleColumns:
    """The answer to a put_many of a [4, 4] and a [16] float32 tensor, in two
    segments of 4096 bytes, with ``change`` made to its columns."""
    cols = dict(
        names=["a", "b"],
        versions=[1, 1],
        segment=[0, 1],
        segments=["td-a", "td-b"],
        offsets=[0, 4032],
        nbytes=[64, 64],
        shapes=[[4, 4], [16]],
        dtypes=["float32", "float32"],
        leases=None,
        others={},
    )
    return HandleColumns.model_construct(**{**cols, **change})


@pytest.mark.parametrize(
    "change,problem",
    [
        ({}, None),
        ({"shapes": [[4, 4], [4, 4]]}, "asked for"),  # the right bytes, not the shape asked for
        ({"dtypes": ["float32", "int32"]}, "asked for"),
        ({"nbytes": [64, 32]}, "bytes, not its 32"),
        ({"offsets": [0, 4040]}, "not within its segment of 4096 bytes"),  # ends past the end
        ({"offsets": [-64, 4032]}, "not within its segment"),
        ({"segment": [1, 1], "offsets": [4032, 4032]}, None),  # two in one segment, both within
    ],
)
def test_a_batch_of_allocations_passes_in_bulk_only_when_each_would_pass_alone(
    change: dict[str, Any], problem: str | None
) -> None:
    cols = _allocated(**change)
    asked = ([[4, 4], [16]], ["float32", "float32"], [64, 64])
    if problem is None:
        check_allocations(cols, [4096, 4096], *asked)
    else:
        with pytest.raises(TensorBroken, match=problem):
            check_allocations(cols, [4096, 4096], *asked)


@pytest.mark.parametrize(
    "change,problem",
    [
        ({}, None),
        ({"offsets": [0, 4040]}, "not within its segment of 4096 bytes"),  # a layout that passed
        ({"offsets": [-64, 4032]}, "not within its segment"),
        ({"nbytes": [64, 32]}, "bytes, not its 32"),  # a layout never seen
        ({"shapes": [[4, 4], [-16]]}, "dimensions >= 0"),
        ({"dtypes": ["float32", "float99"]}, "unknown"),
    ],
)
def test_a_segment_of_a_batch_passes_in_bulk_only_when_each_handle_would_pass_alone(
    change: dict[str, Any], problem: str | None
) -> None:
    check_segment(_allocated(segment=[0, 0]), [0, 1], 4096)  # both layouts pass and are kept
    cols = _allocated(segment=[0, 0], **change)
    if problem is None:
        check_segment(cols, [0, 1], 4096)
    else:
        with pytest.raises(TensorBroken, match=problem):
            check_segment(cols, [0, 1], 4096)
