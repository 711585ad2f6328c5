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
    check_packs,
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


def _cols(
    pack: list[int], layout: list[int], others: dict[int, object] | None = None, **change: Any
) -> HandleColumns:
    n = len(pack)
    cols = dict(
        names=[f"t{i}" for i in range(n)],
        versions=[1] * n,
        segments=["td-a", "td-b"],
        packs=[(0, 0, 4096, None), (1, 0, 4096, None)],
        pack=pack,
        at=[0] * n,
        layouts=[([1], "float32", 4)],
        layout=layout,
        others=others or {},
    )
    return HandleColumns.model_construct(**{**cols, **change})


@pytest.mark.parametrize(
    "pack,layout,others,change,ok",
    [
        ([0, 1, 0], [0, 0, 0], None, {}, True),
        ([], [], None, {}, True),
        ([0, 2], [0, 0], None, {}, False),  # there are two packs
        ([0, -1], [0, -1], None, {}, False),  # -1 says "in others", and others is empty
        ([0, -1], [0, -1], {1: object()}, {}, True),
        ([0, 1], [0, 0], {1: object()}, {}, False),  # in others and in a pack
        ([0, -1], [0, 0], {1: object()}, {}, False),  # in others, with a layout
        ([0, 0], [0, 1], None, {}, False),  # there is one layout
        ([0, 0], [0, -1], None, {}, False),
        ([0], [0], None, {"packs": [(2, 0, 4096, None)]}, False),  # there are two segments
        ([0], [0], None, {"packs": [(0, -64, 4096, None)]}, False),
        ([0], [0], None, {"versions": [1, 1]}, False),  # a column too long
    ],
)
def test_batch_columns_name_packs_layouts_and_segments_of_the_batch(
    pack: list[int], layout: list[int], others: Any, change: dict[str, Any], ok: bool
) -> None:
    cols = _cols(pack, layout, others, **change)
    if ok:
        check_columns(cols)
    else:
        with pytest.raises(TensorBroken):
            check_columns(cols)


def _allocated(**change: Any) -> HandleColumns:
    """The answer to a put_many of a [4, 4] and a [16] float32 tensor, in two
    segments of 4096 bytes, one pack each, with ``change`` made to its columns."""
    cols = dict(
        names=["a", "b"],
        versions=[1, 1],
        segments=["td-a", "td-b"],
        packs=[(0, 0, 4096, None), (1, 0, 4096, None)],
        pack=[0, 1],
        at=[0, 4032],
        layouts=[([4, 4], "float32", 64), ([16], "float32", 64)],
        layout=[0, 1],
        others={},
    )
    return HandleColumns.model_construct(**{**cols, **change})


def _checked(cols: HandleColumns, asked: tuple[Any, ...] | None = None) -> None:
    """What a get_many (and, ``asked``, a put_many) checks of its columns."""
    check_columns(cols)
    check_packs(cols, [4096, 4096])
    if asked is not None:
        check_allocations(cols, *asked)


F32 = "float32"


@pytest.mark.parametrize(
    "change,problem",
    [
        ({}, None),
        ({"layouts": [([4, 4], F32, 64), ([4, 4], F32, 64)]}, "asked for"),  # the right bytes
        ({"layouts": [([4, 4], F32, 64), ([16], "int32", 64)]}, "asked for"),
        ({"layouts": [([4, 4], F32, 64), ([16], F32, 32)]}, "bytes, not its 32"),
        ({"at": [0, 4040]}, "not within its pack of 4096 bytes"),  # ends past the end
        ({"at": [-64, 4032]}, "not within its pack"),
        ({"packs": [(0, 0, 4096, None), (1, 64, 4096, None)]}, "not within its segment of 4096"),
        ({"pack": [1, 1], "at": [0, 4032]}, None),  # two in one pack, both within
        ({"layout": [1, 0]}, "asked for"),
    ],
)
def test_a_batch_of_allocations_passes_in_bulk_only_when_each_would_pass_alone(
    change: dict[str, Any], problem: str | None
) -> None:
    cols = _allocated(**change)
    asked = ([[4, 4], [16]], ["float32", "float32"], [64, 64])
    if problem is None:
        _checked(cols, asked)
    else:
        with pytest.raises(TensorBroken, match=problem):
            _checked(cols, asked)


@pytest.mark.parametrize(
    "change,problem",
    [
        ({}, None),
        ({"at": [0, 4040]}, "not within its pack of 4096 bytes"),  # a layout that passed
        ({"at": [-64, 4032]}, "not within its pack"),
        ({"packs": [(0, 0, 4096, None), (1, 32, 4096, None)]}, "not within its segment"),
        ({"layouts": [([4, 4], F32, 64), ([16], F32, 32)]}, "bytes, not its 32"),  # never seen
        ({"layouts": [([4, 4], F32, 64), ([-16], F32, 64)]}, "dimensions >= 0"),
        ({"layouts": [([4, 4], F32, 64), ([16], "float99", 64)]}, "unknown"),
    ],
)
def test_a_batch_got_passes_in_bulk_only_when_each_handle_would_pass_alone(
    change: dict[str, Any], problem: str | None
) -> None:
    _checked(_allocated())  # both layouts pass and are kept
    cols = _allocated(**change)
    if problem is None:
        _checked(cols)
    else:
        with pytest.raises(TensorBroken, match=problem):
            _checked(cols)
