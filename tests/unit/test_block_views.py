"""BlockViews: a pull's destination blocks, each view made when asked for (issue 15 item 9)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvconnectors.mover.block_views import BlockViews


def _layers(n_layers: int = 3, blocks: int = 8, row: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (blocks, row), dtype=np.uint8) for _ in range(n_layers)]


def test_views_are_the_rows_layer_after_layer_and_writable():
    arrays = _layers()
    views = BlockViews(arrays, [2, 0], [5, 1, 6])
    assert len(views) == 6
    want = [(2, 5), (2, 1), (2, 6), (0, 5), (0, 1), (0, 6)]
    assert [bytes(v) for v in views] == [arrays[layer][b].tobytes() for layer, b in want]
    assert bytes(views[-1]) == arrays[0][6].tobytes()
    assert [bytes(v) for v in views[1:4]] == [arrays[layer][b].tobytes() for layer, b in want[1:4]]
    views[4][0] = views[4][0] ^ 0xFF  # the array itself, not a copy
    assert arrays[0][1][0] == views[4][0]
    with pytest.raises(IndexError):
        views[6]


def test_addrs_are_each_views_address_for_strided_layers_too():
    base = np.zeros((16, 96), dtype=np.uint8)
    arrays = [base[:, :64], base[::2, 32:]]  # rows of 64 B inside wider rows, every other row
    views = BlockViews(arrays, [0, 1], [3, 0, 7])
    addrs = views.addrs()
    assert addrs.dtype == np.uint64 and len(addrs) == len(views)
    for v, a in zip(views, addrs):
        assert ctypes.addressof(ctypes.c_char.from_buffer(v)) == int(a)


def test_of_rows_is_every_row_in_order():
    rows = _layers(1)[0]
    views = BlockViews.of_rows(rows)
    assert len(views) == len(rows) and all(bytes(v) == r.tobytes() for v, r in zip(views, rows))


@pytest.mark.parametrize("bad", [np.zeros((4, 8), np.float32), np.zeros(32, np.uint8), np.zeros((8, 4), np.uint8).T])
def test_arrays_that_are_not_rows_of_bytes_are_refused(bad):
    with pytest.raises(ValueError, match="layer 0"):
        BlockViews([bad], [0], [0])


def test_layers_of_other_row_widths_are_refused():
    with pytest.raises(ValueError, match="layer 1: rows must be 2-D uint8, contiguous, 64 B each"):
        BlockViews([np.zeros((4, 64), np.uint8), np.zeros((4, 32), np.uint8)], [0, 1], [0])
    assert BlockViews(_layers(), [0, 1], [0]).row_bytes == 64


@pytest.mark.parametrize("ids", [[0, 8], [-1, 2]])
def test_block_ids_outside_a_layer_are_refused_before_any_address_is_made(ids):
    """addrs() hands raw addresses to copies that trust them: an id past the end (or a negative one,
    which numpy would wrap) must never become one."""
    with pytest.raises(IndexError, match="outside layer 2's 8 blocks"):
        BlockViews(_layers(), [2], ids)
