"""parse_size: the size strings operators write in store configs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvconnectors.store.sizes import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("4096", 4096), (" 4096 ", 4096), ("0", 0), ("1_024", 1024),
    ("8g", 8 << 30), ("8G", 8 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20), ("16 KiB", 16384),
    ("1.5GB", 1_500_000_000), ("2kb", 2000), ("1.5GiB", 3 << 29), (".5k", 512), ("1e3", 1000),
    ("3b", 3), ("1t", 1 << 40), ("2TB", 2 * 10**12), (4096.0, 4096),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "g", "-1", -1, "1.2.3", "12 bananas", "1 g b", "inf", True, None, [4096],
                                 float("nan"), "0x10"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("bad", [1.5, 1.9, 0.5])
def test_a_fractional_number_of_bytes_is_refused_with_the_unit_it_lacks(bad):
    """A number like 1.5 is a unit left out (issue 41: dram_bytes 1.5 became 1 byte)."""
    with pytest.raises(ValueError, match=rf"whole, got {bad!r} \(with a unit: '{bad:g}g'"):
        parse_size(bad)


@given(st.integers(0, 2**50), st.sampled_from([("", 1), ("k", 1024), ("KiB", 1024), ("MB", 10**6), ("g", 1 << 30)]))
@settings(max_examples=60, deadline=None)
def test_parse_size_integers_are_exact(n, unit):
    suffix, mult = unit
    assert parse_size(f"{n}{suffix}") == n * mult


def test_format_size():
    assert format_size(100) == "100B"
    assert format_size(16384) == "16.0KiB"
    assert format_size(3 << 30) == "3.0GiB"
