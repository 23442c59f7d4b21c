"""StoreConfig validation: every bad value is a ConfigError naming the key and the value."""

from __future__ import annotations

import os

import pytest

from kvconnectors.errors import ConfigError
from kvconnectors.store.config import StoreConfig


def _bad(key: str, value: object, **kw) -> ConfigError:
    base = {"slot_bytes": 4096, "dram_bytes": "64KiB"}
    base.update(kw)
    with pytest.raises(ConfigError) as ei:
        StoreConfig(**base)
    err = ei.value
    assert err.key == key, err
    assert key in str(err) and repr(value) in str(err), str(err)
    return err


def test_sizes_are_parsed(tmp_path):
    cfg = StoreConfig(slot_bytes="16KiB", dram_bytes="1m", nvme_dirs=[str(tmp_path / "x")], nvme_bytes="2MB",
                      max_io_bytes="1MiB", nvme_create_dirs=True)
    assert (cfg.slot_bytes, cfg.dram_bytes, cfg.nvme_bytes, cfg.max_io_bytes) == (16384, 1 << 20, 2_000_000, 1 << 20)
    assert cfg.dram_slots == 64 and cfg.nvme_slots_per_dir == 122
    assert os.path.isdir(tmp_path / "x")  # created on validation, as nvme_create_dirs asks
    assert cfg.lease_ttl_s == 30.0 and cfg.o_direct == "auto"


@pytest.mark.parametrize("key, value", [("slot_bytes", 0), ("slot_bytes", -4096), ("slot_bytes", "4 parsecs"),
                                        ("dram_bytes", 0), ("dram_bytes", "-1g"), ("max_io_bytes", 0)])
def test_non_positive_or_garbage_sizes(key, value):
    _bad(key, value, **{key: value})


def test_dram_smaller_than_one_slot():
    err = _bad("dram_bytes", 4095, dram_bytes=4095)
    assert "smaller than one slot" in err.why


@pytest.mark.parametrize("ttl", [0, -5, float("nan"), float("inf"), "30", True])
def test_bad_ttl(ttl):
    _bad("lease_ttl_s", ttl, lease_ttl_s=ttl)


def test_nvme_bytes_without_dirs():
    _bad("nvme_bytes", 1 << 20, nvme_bytes="1MiB")


def test_nvme_budget_below_one_slot_per_dir(tmp_path):
    _bad("nvme_bytes", 4096, nvme_bytes=4096, nvme_dirs=[str(tmp_path / "a"), str(tmp_path / "b")])


def test_uncreatable_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    d = str(blocker / "sub")
    err = _bad("nvme_dirs", d, nvme_dirs=[d], nvme_bytes="1MiB", nvme_create_dirs=True)
    assert "cannot create" in err.why


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _bad("nvme_dirs", str(f), nvme_dirs=[str(f)], nvme_bytes="1MiB")


def test_unwritable_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        if os.access(d, os.W_OK) and os.geteuid() == 0:
            # root ignores mode bits; a read-only mount is the only honest test then
            ro = "/proc/self"
            if os.access(ro, os.W_OK):
                pytest.skip("no unwritable directory available to root here")
            _bad("nvme_dirs", ro, nvme_dirs=[ro], nvme_bytes="1MiB")
        else:
            err = _bad("nvme_dirs", str(d), nvme_dirs=[str(d)], nvme_bytes="1MiB")
            assert "not writable" in err.why
    finally:
        d.chmod(0o755)


def test_duplicate_dirs(tmp_path):
    d = str(tmp_path)
    _bad("nvme_dirs", [d, d + "/"], nvme_dirs=[d, d + "/"], nvme_bytes="1MiB")


@pytest.mark.parametrize("key, value", [("io_threads", 0), ("io_threads", 1.5), ("tombstones", 0),
                                        ("o_direct", "sometimes"), ("instance_name", "a-b"), ("instance_name", ""),
                                        ("shm_name", "../etc/x"), ("shm_name", "")])
def test_other_bad_values(key, value):
    _bad(key, value, **{key: value})


def test_o_direct_forced_needs_aligned_slots():
    _bad("o_direct", True, o_direct=True, slot_bytes=1000, dram_bytes=8000)


@pytest.mark.parametrize("text, mode", [("auto", "auto"), ("true", True), ("off", False), (True, True), (False, False)])
def test_o_direct_spellings(text, mode):
    assert StoreConfig(slot_bytes=4096, dram_bytes=8192, o_direct=text).o_direct == mode


def test_from_dict_rejects_unknown_and_missing_keys():
    assert StoreConfig.from_dict({"slot_bytes": "4k", "dram_bytes": "8k"}).dram_slots == 2
    with pytest.raises(ConfigError) as ei:
        StoreConfig.from_dict({"slot_bytes": 4096, "dram_bytes": 8192, "dram_byts": 1})
    assert ei.value.key == "dram_byts"
    with pytest.raises(ConfigError) as ei:
        StoreConfig.from_dict({"slot_bytes": 4096})
    assert ei.value.key == "dram_bytes"
