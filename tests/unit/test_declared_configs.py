"""Declared configs (#15 item 3): TieredConfig, StoreConfig and ProxyConfig as msgspec Structs whose
fields are the one source of type, range, default and help; "did you mean" for unknown keys;
nvme_dirs that must exist unless nvme_create_dirs; a warning for decimal size units; the proxy's
flags derived from ProxyConfig, and serve-pd building that config directly."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest

from kvconnectors.integration import launcher as L
from kvconnectors.integration import proxy as P
from kvconnectors import settings
from kvconnectors.errors import ConfigError
from kvconnectors.store import sizes
from kvconnectors.store.config import StoreConfig
from kvconnectors.tiered.config import TieredConfig

REPO = Path(__file__).resolve().parents[2]
BASE = {"slot_bytes": 4096, "dram_bytes": "64KiB"}


def _error(make, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        make(**kw)
    return ei.value


# ---------------------------------------------------------------------------------------------------
# constraints


@pytest.mark.parametrize("extra, why", [
    ({"transport": "udp"}, "must be one of tcp, shm, nixl"),                 # Literal, in declared order
    ({"failure_policy": "sometimes"}, "must be one of fail, recompute, retry (or null: unset)"),
    ({"retries": 11}, "must be an integer in [0, 10]"),                      # Meta(ge=0, le=10)
    ({"retries": 1.0}, "must be an integer in [0, 10]"),                     # strict: no float for an int
    ({"layer_group_size": 0}, "must be an integer >= 1"),
    ({"store_port": 65536}, "must be an integer port in [0, 65535] (0 = any free)"),
    ({"load_timeout_s": float("inf")}, "must be a finite number of seconds > 0"),
    ({"heartbeat_interval_s": float("nan")}, "must be a finite number of seconds > 0 (or null: unset)"),
    ({"checksum": 1}, "must be true or false"),
    ({"nvme_dirs": "/mnt/nvme0"}, "must be a list of directory paths"),
])
def test_tiered_constraints_name_key_value_and_rule(extra, why) -> None:
    """Each declared constraint refuses with the key, the value and the rule. Negative control:
    with `settings.check_fields(self)` removed from TieredConfig.__post_init__, these construct
    (retries=11, transport='udp' ...) and the test fails on "DID NOT RAISE"."""
    (key, value), = extra.items()
    err = _error(TieredConfig.from_extra, extra=extra)
    assert (err.key, err.why) == (key, why), err
    assert f"{key}={value!r}" in str(err)


def test_declared_values_are_normalised_and_in_range_values_pass() -> None:
    """The other side of the constraints: edge values pass, an int for a float becomes a float."""
    cfg = TieredConfig.from_extra({"retries": 10, "store_port": 65535, "lease_ttl_s": 3, "transport": "nixl",
                                   "failure_policy": None})
    assert (cfg.retries, cfg.store_port, cfg.lease_ttl_s, cfg.heartbeat_interval_s) == (10, 65535, 3.0, 1.0)
    assert isinstance(cfg.lease_ttl_s, float)


@pytest.mark.parametrize("kw, key, why", [
    ({"io_threads": 0}, "io_threads", "must be an integer >= 1"),
    ({"tombstones": "10"}, "tombstones", "must be an integer >= 1"),
    ({"dram_prefault": "yes"}, "dram_prefault", "must be true or false"),
    ({"nvme_create_dirs": 1}, "nvme_create_dirs", "must be true or false"),
    ({"lease_ttl_s": float("inf")}, "lease_ttl_s", "must be a finite number of seconds > 0"),
])
def test_store_constraints(kw, key, why) -> None:
    """Negative control: without settings.check_fields in StoreConfig.__post_init__, io_threads=0 and
    dram_prefault='yes' construct and this fails on "DID NOT RAISE"."""
    err = _error(StoreConfig, **BASE, **kw)
    assert (err.key, err.why) == (key, why), err


@pytest.mark.parametrize("kw, key, why", [
    ({"mode": "both"}, "mode", "must be one of pull, push"),
    ({"port": 65536}, "port", "must be an integer in [0, 65535]"),
    ({"prefill_retries": -1}, "prefill_retries", "must be an integer >= 0"),
    ({"connect_timeout": 0}, "connect_timeout", "must be a number > 0"),
    ({"log_level": "debug"}, "log_level", "must be one of DEBUG, INFO, WARNING, ERROR"),  # the CLI upper-cases
    ({"forward_kv_params": "kvc_fault"}, "forward_kv_params", "must be a list of strings"),
])
def test_proxy_constraints(kw, key, why) -> None:
    """ProxyConfig built in code (PDCluster, tests) is checked like one from flags. Negative control:
    without settings.check_fields in ProxyConfig.__post_init__, these construct."""
    err = _error(P.ProxyConfig, prefill=[P.InstanceSpec("http://p:1")], decode=[P.InstanceSpec("http://d:1")], **kw)
    assert (err.key, err.why) == (key, why), err


# ---------------------------------------------------------------------------------------------------
# unknown keys


@pytest.mark.parametrize("make, key, close", [
    (TieredConfig.from_extra, "lease_ttl", "lease_ttl_s"),
    (TieredConfig.from_extra, "transfer_mod", "transfer_mode"),
    (TieredConfig.from_extra, "nvme_dir", "nvme_dirs"),
    (lambda d: StoreConfig.from_dict({**BASE, **d}), "dram_byts", "dram_bytes"),
    (lambda d: StoreConfig.from_dict({**BASE, **d}), "io_thread", "io_threads"),
])
def test_unknown_key_says_did_you_mean(make, key, close) -> None:
    """Negative control: with the get_close_matches hint removed from settings.from_mapping, the
    message has no "did you mean" and this fails."""
    with pytest.raises(ConfigError) as ei:
        make({key: 1})
    assert ei.value.key == key
    assert f"did you mean {close!r}?" in ei.value.why, ei.value
    assert "known settings:" in ei.value.why  # the full list stays, for keys nothing is close to


def test_unknown_key_far_from_every_known_one_has_no_guess() -> None:
    """Negative control for the hint: a key like no setting gets the list, not a wrong guess."""
    with pytest.raises(ConfigError) as ei:
        TieredConfig.from_extra({"zzzz": 1})
    assert "did you mean" not in ei.value.why and "known settings: advertise_host" in ei.value.why


# ---------------------------------------------------------------------------------------------------
# nvme_dirs


def test_missing_nvme_dir_is_refused_and_not_created(tmp_path) -> None:
    """A typo in nvme_dirs must not become a new directory. Negative control: with the old
    unconditional os.makedirs back in _check_writable_dir, the store accepts the path, creates it,
    and this fails on "DID NOT RAISE"."""
    d = tmp_path / "nvme0"
    err = _error(StoreConfig, **BASE, nvme_dirs=[str(d)], nvme_bytes="1MiB")
    assert err.key == "nvme_dirs" and err.value == str(d), err
    assert "does not exist" in err.why and "nvme_create_dirs" in err.why, err
    assert not d.exists()


def test_missing_nvme_dir_names_a_close_existing_one(tmp_path) -> None:
    """"nmve0" beside an existing "nvme0": the error points at it. Negative control: _near returning
    "" drops the hint and this fails."""
    (tmp_path / "nvme0").mkdir()
    err = _error(StoreConfig, **BASE, nvme_dirs=[str(tmp_path / "nmve0")], nvme_bytes="1MiB")
    assert f"did you mean {str(tmp_path / 'nvme0')!r}?" in err.why, err


def test_nvme_create_dirs_creates_them(tmp_path) -> None:
    """The explicit flag restores mkdir -p. Negative control: ignoring `create` in
    _check_writable_dir makes this raise "does not exist"."""
    dirs = [tmp_path / "a" / "nvme0", tmp_path / "a" / "nvme1"]
    cfg = StoreConfig(**BASE, nvme_dirs=[str(d) for d in dirs], nvme_bytes="1MiB", nvme_create_dirs=True)
    assert all(d.is_dir() for d in dirs) and cfg.nvme_slots_per_dir == 128


def test_existing_nvme_dirs_and_a_disabled_tier_need_no_flag(tmp_path) -> None:
    StoreConfig(**BASE, nvme_dirs=[str(tmp_path)], nvme_bytes="1MiB")
    StoreConfig(**BASE, nvme_dirs=[str(tmp_path / "unused")], nvme_bytes=0)  # no tier: the dirs are not used
    assert not (tmp_path / "unused").exists()


def test_tiered_config_carries_the_create_flag_to_its_store() -> None:
    """TieredConfig declares the key; the worker passes it on when it builds the StoreConfig.
    Negative control: dropping `nvme_create_dirs=cfg.nvme_create_dirs` from worker.py fails the
    second assertion."""
    assert TieredConfig.from_extra({"nvme_create_dirs": True}).nvme_create_dirs is True
    worker = (REPO / "kvconnectors" / "tiered" / "worker.py").read_text()
    assert "nvme_create_dirs=cfg.nvme_create_dirs" in worker


# ---------------------------------------------------------------------------------------------------
# sizes


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(sizes, "_warned", set())


def _size_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvconnectors.store.sizes"]


def test_decimal_unit_is_accepted_and_warned_about_once(fresh_warnings, caplog) -> None:
    """"8gb" is 8*10^9 bytes, accepted, with one warning naming the key, the value, the byte count
    and the binary spelling; a second config with the same value does not repeat it. Negative
    control: without the log.warning in size_setting, the first assertion on the message fails."""
    caplog.set_level(logging.WARNING, logger="kvconnectors.store.sizes")
    assert TieredConfig.from_extra({"dram_bytes": "8gb"}).dram_bytes == 8 * 10**9
    TieredConfig.from_extra({"dram_bytes": "8gb"})
    msgs = _size_warnings(caplog)
    assert len(msgs) == 1, msgs
    assert "dram_bytes='8gb'" in msgs[0] and "8000000000 bytes" in msgs[0], msgs[0]
    assert "'8GiB' = 8589934592 bytes" in msgs[0], msgs[0]


@pytest.mark.parametrize("value, binary", [("1.5GB", "'1.5GiB' = 1610612736"), ("512 MB", "'512MiB' = 536870912"),
                                           ("2kb", "'2KiB' = 2048")])
def test_each_decimal_spelling_is_warned_with_its_binary_twin(fresh_warnings, caplog, value, binary) -> None:
    caplog.set_level(logging.WARNING, logger="kvconnectors.store.sizes")
    StoreConfig(slot_bytes=1024, dram_bytes=value)
    msgs = _size_warnings(caplog)
    assert len(msgs) == 1 and f"dram_bytes={value!r}" in msgs[0] and binary in msgs[0], msgs


@pytest.mark.parametrize("value", ["8g", "8GiB", "8 MiB", 8 << 30, "4096", "3b"])
def test_binary_units_and_plain_bytes_are_not_warned_about(fresh_warnings, caplog, value) -> None:
    """Negative control for the warning: with decimal_unit() returning the unit for every suffix,
    "8g" warns and this fails."""
    caplog.set_level(logging.WARNING, logger="kvconnectors.store.sizes")
    StoreConfig(slot_bytes=1, dram_bytes=value)
    assert _size_warnings(caplog) == []


def test_parse_size_itself_stays_silent(fresh_warnings, caplog) -> None:
    """parse_size knows no key: only configs warn (benchmarks parse their own flags with it)."""
    caplog.set_level(logging.WARNING, logger="kvconnectors.store.sizes")
    assert sizes.parse_size("8gb") == 8 * 10**9 and _size_warnings(caplog) == []


# ---------------------------------------------------------------------------------------------------
# the proxy's flags, derived


def _proxy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    return parser


def test_every_proxy_setting_has_its_flag_default_and_help() -> None:
    """One source: each ProxyConfig field is a flag whose default is the field's default and whose
    help is the field's doc. Negative control: with settings.add_arguments giving every flag
    default=None, the default check fails."""
    actions = {a.dest: a for a in _proxy_parser()._actions if a.option_strings and a.dest != "help"}
    cli_fields = list(settings.fields(P.ProxyConfig))
    assert sorted(actions) == sorted(f.name for f in cli_fields)
    for f in cli_fields:
        a = actions[f.name]
        assert a.option_strings == ["--" + f.name.replace("_", "-")]
        assert a.help == settings.doc(P.ProxyConfig, f.name) and a.help
        assert a.required if f.required else a.default == f.default, f.name


def test_the_flags_are_the_ones_of_before() -> None:
    """Every flag name of the hand-written parser this replaced, with the cli_types types, the
    body limits added since (issue 16), the slow/hostile-client limits (issue 34) and --kv-both (issue 41)."""
    from kvconnectors import cli_types

    actions = {a.option_strings[0]: a for a in _proxy_parser()._actions if a.option_strings}
    assert set(actions) == {"-h", "--prefill", "--decode", "--host", "--port", "--mode", "--connect-timeout",
                            "--prefill-timeout", "--decode-timeout", "--decode-idle-timeout", "--prefill-retries",
                            "--health-interval", "--health-timeout", "--unhealthy-after", "--max-connections",
                            "--log-level", "--forward-kv-params", "--max-body-bytes", "--max-inflight-body-bytes",
                            "--max-body-strings", "--body-timeout", "--header-timeout", "--keepalive-timeout",
                            "--max-client-connections", "--max-client-requests", "--metrics-host", "--metrics-port",
                            "--metrics-token-file", "--unlock-transfer-keys", "--kv-both"}
    assert actions["--port"].type is cli_types.port_or_zero and actions["--log-level"].type is cli_types.log_level
    assert actions["--prefill-retries"].type is cli_types.non_negative_int
    assert actions["--log-level"].choices == cli_types.LOG_LEVELS and actions["--mode"].choices == ("pull", "push")


def test_config_argv_round_trips() -> None:
    """config -> argv -> config is the identity, so a subprocess proxy runs with the in-process
    settings. Negative control: with FORMAT ignored in settings.to_argv, --decode is written as
    str(InstanceSpec(...)), which does not parse back, and this fails."""
    cfg = P.ProxyConfig(prefill=[P.InstanceSpec("http://p:1"), P.InstanceSpec("http://p:2")],
                        decode=[P.InstanceSpec("http://d:1", "127.0.0.1:7000")], port=0, mode="push",
                        decode_timeout=0.5, log_level="DEBUG", forward_kv_params=("kvc_fault", "x"))
    argv = P.config_argv(cfg)
    assert P.config_from_args(_proxy_parser().parse_args(argv)) == cfg
    assert "--connect-timeout" not in argv  # defaults are not repeated


def test_serve_pd_builds_the_proxy_config_directly() -> None:
    """The launcher's proxy config comes from its plans, --proxy-args amending it (a repeated
    --decode adds an instance, --prefill-retries replaces); it equals what the printed command
    line parses into. Negative control: appending instead of replacing for scalar flags (or
    replacing the pools) fails the equalities."""
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--mode", "push", "--proxy-port", "9999", "--proxy-args",
                              "--prefill-retries 0 --decode http://extra:1,kv=h:2"])
    plans = L.plan_instances(args, cores=[0], port_fn=iter(range(30000, 30100)).__next__)
    cfg = L.proxy_config(plans, args)
    assert (cfg.port, cfg.mode, cfg.prefill_retries) == (9999, "push", 0)
    assert [d.url for d in cfg.decode] == [plans[1].url("127.0.0.1"), "http://extra:1"]
    assert L.parse_proxy_argv(L.proxy_argv(plans, args)) == cfg


def test_serve_pd_bad_proxy_args_name_the_flag() -> None:
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--proxy-args", "--prefill-timeout 0"])
    plans = L.plan_instances(args, cores=[0], port_fn=iter(range(30000, 30100)).__next__)
    with pytest.raises(ValueError, match=r"check --proxy-args\): argument --prefill-timeout"):
        L.proxy_config(plans, args)


# ---------------------------------------------------------------------------------------------------
# the READMEs list the declared settings


def _table_keys(readme: Path, heading: str) -> list[str]:
    text = readme.read_text()
    section = text[text.index(heading):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.M)


@pytest.mark.parametrize("cls, readme, heading", [
    (TieredConfig, REPO / "kvconnectors" / "tiered" / "README.md", "## Settings"),
    (StoreConfig, REPO / "kvconnectors" / "store" / "README.md", "## Settings"),
])
def test_readme_settings_tables_match_the_declared_fields(cls, readme, heading) -> None:
    """Negative control: a field added to the Struct without a README row (or a row left for a
    removed field) fails here."""
    assert sorted(_table_keys(readme, heading)) == sorted(f.name for f in settings.fields(cls))
