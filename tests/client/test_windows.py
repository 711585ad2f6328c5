"""Which tensors of a get_many's segment may share one window (``layout``):
those whose bytes do not overlap, in any order, and those of the very same
range; ranges that only overlap each get a window of their own."""

from __future__ import annotations

from tensordepot.client._windows import layout


def _state_dict_order() -> tuple[list[int], list[int]]:
    """A state dict's offsets in name order: each layer's large weight in a
    block of its own, its small bias and norm in the batch's one pack (placed
    after the first block), so the offsets go back and forth."""
    offsets, nbytes = [], []
    pack = 10_000
    for i in range(50):
        big = 0 if i == 0 else pack + 1_000 + (i - 1) * 10_000
        offsets += [big, pack + 16 * i, pack + 16 * i + 8]
        nbytes += [10_000, 8, 8]
    return offsets, nbytes


def test_a_batch_out_of_order_with_no_overlap_shares_one_window() -> None:
    offsets, nbytes = _state_dict_order()
    shared, alone = layout(range(len(offsets)), offsets, nbytes)
    assert sorted(shared) == list(range(len(offsets))) and alone == []


def test_tensors_of_one_range_share_it_out_of_order() -> None:
    offsets, nbytes = [100, 0, 100, 50], [50, 50, 50, 50]  # 0 and 2: tied weights
    shared, alone = layout(range(4), offsets, nbytes)
    assert sorted(shared) == [0, 1, 2, 3] and alone == []


def test_ranges_that_only_overlap_get_windows_of_their_own() -> None:
    offsets, nbytes = _state_dict_order()
    offsets.append(5)  # inside the first large tensor, not the same range
    nbytes.append(8)
    shared, alone = layout(range(len(offsets)), offsets, nbytes)
    assert sorted(alone) == [[0], [len(offsets) - 1]]
    assert sorted(shared) == list(range(1, len(offsets) - 1))


def test_members_of_one_segment_only() -> None:
    offsets, nbytes = [300, 0, 999, 100], [50, 50, 1, 50]
    shared, alone = layout([0, 1, 3], offsets, nbytes)  # 2: another segment's tensor
    assert sorted(shared) == [0, 1, 3] and alone == []
