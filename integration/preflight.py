"""Checks before anything starts: each instance's `--kv-transfer-config` as vLLM and the connector
will read it, and `--vllm-args` that would quietly override what serve-pd generates.

A typo in a connector setting otherwise surfaces minutes later, after every server has loaded its
model (or never: a misspelt key vLLM ignores is a setting silently lost). Each refusal is a
ValueError naming the flag, the field and the value. `kvconnectors check-config` runs the same
checks on one `--kv-transfer-config`, for configs written by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from kvconnectors.errors import ConfigError

TIERED = "TieredConnector"

# vllm serve flags serve-pd writes for every instance: a copy in --vllm-args would win (vLLM takes
# the last), so the instance would no longer be what serve-pd planned, its proxy included.
GENERATED_FLAGS: dict[str, str] = {
    "--port": "serve-pd gives each instance its own port (the proxy is told them)",
    "--host": "use serve-pd's --host",
    "--model": "use serve-pd's --model",
    "--served-model-name": "use serve-pd's --served-model-name",
    "--kv-transfer-config": "serve-pd writes each instance's; add settings with --kv-transfer-config-extra",
    "--kv-transfer-config-extra": "that is serve-pd's own flag, not vllm serve's",
}
# top-level keys of --kv-transfer-config-extra that serve-pd decides per instance
PLANNED_KEYS: dict[str, str] = {
    "kv_role": "serve-pd makes prefill instances kv_producer and decode instances kv_consumer",
    "kv_connector": "choose it with --connector",
    "kv_connector_module_path": "serve-pd sets it with --connector",
}


def check_vllm_args(vllm_args: str | None) -> None:
    """Refuse --vllm-args flags that serve-pd generates for every instance."""
    for token in shlex.split(vllm_args or ""):
        flag = token.split("=", 1)[0]
        if flag in GENERATED_FLAGS:
            raise ValueError(f"--vllm-args {vllm_args!r}: {flag} is set by serve-pd ({GENERATED_FLAGS[flag]})")


def check_user_extra(extra: Mapping[str, Any] | None) -> None:
    """Refuse keys of --kv-transfer-config-extra that serve-pd decides per instance."""
    for key, why in PLANNED_KEYS.items():
        if extra and key in extra:
            raise ValueError(f"--kv-transfer-config-extra: {key}={extra[key]!r} cannot be set ({why})")


def check_transfer_config(config: Mapping[str, Any], *, create_dirs: bool = False) -> Any:
    """One instance's --kv-transfer-config: vLLM's own KVTransferConfig check (unknown keys, kv_role,
    types) where vLLM is installed, then, for TieredConnector, every setting of
    kv_connector_extra_config, what the instance's role needs and what start-up would find on this
    host (`TieredConfig.check_local`). Returns the TieredConfig (None for other connectors);
    ConfigError naming the key and the value."""
    _check_with_vllm(config)
    if config.get("kv_connector") != TIERED:
        return None
    from kvconnectors.tiered.config import TieredConfig  # noqa: PLC0415 - only for TieredConnector

    extra = config.get("kv_connector_extra_config") or {}
    try:
        tiered = TieredConfig.from_extra(extra)
        tiered.check_role(config.get("kv_role"))
        tiered.check_local(create_dirs=create_dirs)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config.{exc.key}", exc.value, exc.why) from None
    return tiered


def _check_with_vllm(config: Mapping[str, Any]) -> None:
    try:
        from vllm.config.kv_transfer import KVTransferConfig  # noqa: PLC0415 - seconds to import
    except ImportError:
        return  # a dry run on a machine without vLLM: the connector's own checks still run
    from pydantic import ValidationError  # noqa: PLC0415 - vLLM's config classes are pydantic

    try:
        KVTransferConfig(**config)
    except ValidationError as exc:
        known = [f.name for f in dataclasses.fields(KVTransferConfig)]
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"]) or "kv_transfer_config"
        value = err.get("input")
        if err["type"] == "unexpected_keyword_argument":
            raise ConfigError(key, value, "is not a vLLM KVTransferConfig field" + _closest(key, known)) from None
        raise ConfigError(key, value, err["msg"]) from None


def _closest(key: str, known: list[str]) -> str:
    """"; did you mean ...?" for a misspelt top-level field, or for a connector setting written at the
    top level instead of inside kv_connector_extra_config."""
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    from kvconnectors import settings  # noqa: PLC0415
    from kvconnectors.tiered.config import TieredConfig  # noqa: PLC0415

    setting = difflib.get_close_matches(key, [f.name for f in settings.fields(TieredConfig)], n=1)
    if setting:
        return f"; a {TIERED} setting goes inside kv_connector_extra_config: did you mean kv_connector_extra_config.{setting[0]}?"
    return f" (fields: {', '.join(known)})"


# --------------------------------------------------------------------------------------------
# kvconnectors check-config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="JSON",
                        help="a --kv-transfer-config as given to `vllm serve` (a JSON object), or @FILE to read it "
                             "from a file")
    parser.add_argument("--create-dirs", action="store_true",
                        help="create missing nvme_dirs now when nvme_create_dirs is set (by default they are "
                             "left to start-up and not checked)")


def run(args: argparse.Namespace) -> int:
    """Print the effective TieredConnector settings (every default filled in) or the refusal."""
    text = args.config
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        config = json.loads(text)
        if not isinstance(config, dict):
            raise ValueError(f"expected a JSON object, got {args.config!r}")
        tiered = check_transfer_config(config, create_dirs=args.create_dirs)
    except (OSError, ValueError) as exc:  # ConfigError and JSON errors are ValueErrors
        print(f"kvconnectors check-config: error: {exc}", file=sys.stderr)
        return 2
    if tiered is None:
        print(f"{config.get('kv_connector')}: vLLM's KVTransferConfig accepts it (its own settings are its own)")
        return 0
    import msgspec  # noqa: PLC0415

    effective = {k: v for k, v in msgspec.structs.asdict(tiered).items() if k != "fault_plan"}
    print(json.dumps({**config, "kv_connector_extra_config": effective}, indent=2, default=str))
    return 0
