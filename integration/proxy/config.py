"""The proxy's settings: ProxyConfig (declared once; its flags are derived from the fields), the
instance specs, the argparse types that read them, and the argv that writes a config back."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from kvconnectors import settings
from kvconnectors.cli_types import (LOG_LEVELS, MAX_PORT, log_level, non_negative_int, port_or_zero, positive_float,
                                    positive_int)
from kvconnectors.cli_types import port as parse_port
from kvconnectors.errors import ConfigError
from kvconnectors.store.sizes import parse_size

# A request picks its own mode with this header (named in --mode's help, read by the app).
MODE_HEADER = "X-KV-Transfer-Mode"
Mode = Literal["pull", "push"]
MODES: tuple[str, ...] = get_args(Mode)

# kv_transfer_params keys that steer the transfer plane: where a prefill pushes the KV and how (ours
# set them in push mode), and every key of TieredConnector's own (kvc: the ticket, kvc_fault: the
# test hooks' corruption). A client that could set them would choose where its KV goes.
TRANSFER_PLANE_KEYS = ("push_target", "transfer_mode")
TRANSFER_PLANE_PREFIX = "kvc"


def check_forwarded_keys(keys: Sequence[str], *, setting: str, unlocked: bool, unlock: str) -> None:
    """Refuse transfer-plane keys among the client kv_transfer_params keys an operator lets through to
    the prefill leg (ConfigError naming `setting` and the keys), unless `unlocked` (`unlock` says how).
    The one rule of the proxy's --forward-kv-params and the Ray backend's forwarded keys."""
    refused = [k for k in keys if k in TRANSFER_PLANE_KEYS or k.startswith(TRANSFER_PLANE_PREFIX)]
    if refused and not unlocked:
        raise ConfigError(setting, ",".join(keys), (
            f"{', '.join(map(repr, refused))} would let a client steer the transfer plane (where the KV is "
            f"pushed, how it moves, or TieredConnector's test faults): refused unless {unlock}, which is for "
            "tests and chaos runs only"))


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    url: str                      # http://host:port, no trailing slash
    kv_addr: str | None = None    # host:port of the instance's KV store (decode, push mode)


Seconds = Annotated[float, Meta(gt=0)]


def _flag(help: str, *, ge: int | None = None, le: int | None = None, **extra: Any) -> Meta:
    """A setting's range, help text and how its flag reads (`extra`: the keys of kvconnectors/settings.py)."""
    return Meta(ge=ge, le=le, description=help, extra=extra)


def _format_decode(spec: InstanceSpec) -> str:
    return spec.url + (f",kv={spec.kv_addr}" if spec.kv_addr else "")


class ProxyConfig(msgspec.Struct, kw_only=True):
    """Every proxy setting, declared once: type and range, default, and the help of its flag
    (`add_arguments` derives the command line from these fields)."""
    prefill: Annotated[list[InstanceSpec], _flag(
        "a prefill (kv_producer) instance, e.g. http://127.0.0.1:8100; repeat for more",
        parse=parse_prefill, format=lambda s: s.url, repeat=True, metavar="URL")]
    decode: Annotated[list[InstanceSpec], _flag(
        "a decode (kv_consumer) instance; kv= is the address of its KV store, needed for push mode; "
        "repeat for more", parse=parse_decode, format=_format_decode, repeat=True,
        metavar="URL[,kv=HOST:PORT]")]
    host: Annotated[str, _flag("address to listen on (0.0.0.0 for all)")] = "127.0.0.1"
    port: Annotated[int, _flag("port to listen on; 0 picks a free one (the log says which)", ge=0, le=MAX_PORT,
                               parse=port_or_zero)] = 8000
    mode: Annotated[Mode, _flag(
        "pull: decode fetches the KV after prefill; push: prefill pushes it to the chosen decode instance "
        f"while it computes. Per request: header {MODE_HEADER}")] = "pull"
    connect_timeout: Annotated[Seconds, _flag("seconds to open a connection to an instance",
                                              parse=positive_float)] = 5.0
    prefill_timeout: Annotated[Seconds, _flag("seconds for a whole prefill leg (per attempt)",
                                              parse=positive_float)] = 300.0
    decode_timeout: Annotated[Seconds, _flag("seconds for a whole decode leg, streaming included",
                                             parse=positive_float)] = 3600.0
    decode_idle_timeout: Annotated[Seconds, _flag("seconds without any byte from the decode instance before "
                                                  "giving up", parse=positive_float)] = 120.0
    prefill_retries: Annotated[int, _flag("extra prefill attempts, each on another instance, after a connection "
                                          "error or 5xx", ge=0, parse=non_negative_int)] = 2
    health_interval: Annotated[Seconds, _flag("seconds between GET /health rounds over all instances",
                                              parse=positive_float)] = 5.0
    health_timeout: Annotated[Seconds, _flag("seconds for one /health probe", parse=positive_float)] = 2.0
    unhealthy_after: Annotated[int, _flag("failed /health probes in a row before an instance leaves rotation (a "
                                          "refused connection during a request takes it out at once)",
                                          ge=1, parse=positive_int)] = 2
    max_connections: Annotated[int, _flag("upper bound on open upstream connections", ge=1,
                                          parse=positive_int)] = 1024
    max_body_bytes: Annotated[int, _flag(
        "largest client request body, in bytes (64MiB, 8m and 1000000 all work); a larger one is answered 413 "
        "with OpenAI-style error JSON before it is read", ge=1, parse=byte_size, metavar="BYTES")] = 64 * 2**20
    max_inflight_body_bytes: Annotated[int, _flag(
        "request body bytes held at once over all requests in flight, counted as they arrive and held until "
        "the response is sent; a request whose Content-Length does not fit in what is left is answered 503 "
        "(Retry-After: 1) before its body is read, one that crosses the limit while its body arrives the "
        "same. The proxy's memory grows by a few times this at most (the bodies of both legs); at least "
        "--max-body-bytes",
        ge=1, parse=byte_size, metavar="BYTES")] = 256 * 2**20
    max_body_strings: Annotated[int, _flag(
        "most JSON strings (object keys and string values, at any depth) in one request body, counted before "
        "it is decoded; a body with more is answered 400. Only a body's top level is decoded (the rest passes "
        "on as it came), ~150 bytes per field: this bounds what a body of millions of tiny fields costs",
        ge=1, parse=positive_int)] = 65536
    body_timeout: Annotated[Seconds, _flag(
        "seconds a request body may go without a byte arriving; then the request is answered 408 and its "
        "connection closed", parse=positive_float)] = 30.0
    header_timeout: Annotated[Seconds, _flag(
        "seconds a connection has to send a whole request head (request line and headers), from its opening "
        "and from the first byte of each later request on it; then it is closed, unanswered",
        parse=positive_float)] = 10.0
    keepalive_timeout: Annotated[Seconds, _flag(
        "seconds an idle keep-alive connection stays open between requests", parse=positive_float)] = 75.0
    max_client_connections: Annotated[int, _flag(
        "open connections per client address; one more is closed at once, unanswered. 0: no cap",
        ge=0, parse=non_negative_int)] = 512
    max_client_requests: Annotated[int, _flag(
        "requests in flight per client address; one more is answered 429 (OpenAI-style error JSON, "
        "Retry-After: 1). 0: no cap", ge=0, parse=non_negative_int)] = 256
    metrics_host: Annotated[str, _flag("address of the --metrics-port listener")] = "127.0.0.1"
    metrics_port: Annotated[Annotated[int, Meta(ge=0, le=MAX_PORT)] | None, _flag(
        "serve /metrics, /health and /healthcheck on this port of --metrics-host instead of the main port, "
        "which then answers them 404; 0 picks a free one (the log says which). Default: on the main port",
        parse=port_or_zero, metavar="PORT")] = None
    metrics_token_file: Annotated[str | None, _flag(
        "a file holding a token that /metrics, /health and /healthcheck then require as "
        "'Authorization: Bearer TOKEN' (401 without it). Default: open to whoever reaches their port",
        metavar="PATH")] = None
    log_level: Annotated[Literal[LOG_LEVELS], _flag("proxy log level, in any case (debug or DEBUG)",
                                                    parse=log_level)] = "INFO"
    forward_kv_params: Annotated[tuple[str, ...], _flag(
        "keys of the client's own kv_transfer_params to pass on to the prefill leg; none by default. Keys that "
        f"steer the transfer plane ({', '.join(TRANSFER_PLANE_KEYS)}, {TRANSFER_PLANE_PREFIX}*) are refused "
        "unless --unlock-transfer-keys", parse=parse_key_list, format=",".join, metavar="KEY[,KEY...]")] = ()
    unlock_transfer_keys: Annotated[bool, _flag(
        "let --forward-kv-params name transfer-plane keys (e.g. kvc_fault, TieredConnector's test hooks): a "
        "client could then choose where its KV is pushed, or corrupt its transfers. For tests and chaos runs "
        "only")] = False
    kv_both: Annotated[bool, _flag(
        "instances may be listed in both --prefill and --decode: they run kv_role kv_both (without it such a "
        "listing is refused, as one server given as both legs by mistake)")] = False

    def __post_init__(self) -> None:
        settings.check_fields(self)

    def validate(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("need at least one --prefill and one --decode instance")
        if self.mode not in MODES:
            raise ValueError(f"--mode {self.mode!r}: expected one of {MODES}")
        if self.mode == "push":
            missing = [d.url for d in self.decode if not d.kv_addr]
            if missing:
                raise ValueError(f"--mode push needs kv=HOST:PORT on every --decode; missing on {missing}")
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(f"--max-inflight-body-bytes {self.max_inflight_body_bytes} is below --max-body-bytes "
                             f"{self.max_body_bytes}: a body of allowed size could never be taken")
        for flag, specs in (("--prefill", self.prefill), ("--decode", self.decode)):
            urls = [s.url for s in specs]
            dups = sorted({u for u in urls if urls.count(u) > 1})
            if dups:
                raise ValueError(f"{flag} lists the same instance more than once: {dups}")
        both = sorted({s.url for s in self.prefill} & {s.url for s in self.decode})
        if both and not self.kv_both:  # a kv_producer cannot decode, nor a kv_consumer prefill
            raise ValueError(f"--prefill and --decode name the same instance: {both}; a prefill and a decode "
                             "instance are two servers (instances with kv_role kv_both may be both: pass --kv-both)")
        check_forwarded_keys(self.forward_kv_params, setting="--forward-kv-params",
                             unlocked=self.unlock_transfer_keys, unlock="--unlock-transfer-keys is given")
        if self.metrics_port and (self.metrics_host, self.metrics_port) == (self.host, self.port):
            raise ValueError(f"--metrics-port {self.metrics_port} is --port: give the metrics a port of their own")
        self.metrics_token()

    def metrics_token(self) -> bytes | None:
        """The token of --metrics-token-file; None without the flag. Read with the checks of the shared
        secret's file (transport/auth.py: owner-only, in a directory others cannot write, 16+ bytes of 8+
        distinct values): whoever may read or replace it reads the metrics."""
        if self.metrics_token_file is None:
            return None
        from kvconnectors.errors import ConfigError
        from kvconnectors.transport.auth import load_secret

        try:
            token = load_secret(self.metrics_token_file)
        except ConfigError as exc:
            raise ValueError(f"--metrics-token-file {self.metrics_token_file}: {exc.why}") from None
        return bytes(token) if token is not None else None


def parse_url(value: str) -> str:
    """argparse type: an instance base URL, http(s)://host:port, no path."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"invalid URL {value!r}: expected http://HOST:PORT (with the scheme), e.g. http://127.0.0.1:8100")
    try:
        parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port in URL {value!r}") from None
    if parts.path not in ("", "/") or parts.query:
        raise argparse.ArgumentTypeError(
            f"invalid URL {value!r}: give the server root (http://HOST:PORT), not a path like /v1")
    return f"{parts.scheme}://{parts.netloc}"


def parse_key_list(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated kv_transfer_params keys."""
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys or not all(k.replace("_", "").isalnum() for k in keys):
        raise argparse.ArgumentTypeError(f"invalid key list {value!r}: expected KEY[,KEY...] of letters, digits, _")
    return keys


def byte_size(value: str) -> int:
    """argparse type: a positive byte count, with the store's units (64MiB, 8m, 1GB; store/sizes.py)."""
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {value!r}")
    return n


def parse_hostport(value: str) -> str:
    host, sep, port_text = value.rpartition(":")
    try:
        port: int | None = parse_port(port_text)
    except argparse.ArgumentTypeError:
        port = None
    if not sep or not host or port is None:
        raise argparse.ArgumentTypeError(f"invalid address {value!r}: expected HOST:PORT")
    return f"{host}:{port}"


def parse_prefill(value: str) -> InstanceSpec:
    return InstanceSpec(parse_url(value))


def parse_decode(value: str) -> InstanceSpec:
    """argparse type: `URL` or `URL,kv=HOST:PORT`."""
    url, *opts = value.split(",")
    kv = None
    for opt in opts:
        key, _, val = opt.partition("=")
        if key.strip() != "kv":
            raise argparse.ArgumentTypeError(f"unknown option {opt!r} in {value!r}: expected URL[,kv=HOST:PORT]")
        try:
            kv = parse_hostport(val.strip())
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"invalid kv address {val!r} in {value!r}: expected kv=HOST:PORT") from None
    return InstanceSpec(parse_url(url), kv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ProxyConfig setting: --prefill, --decode, --host, --port, --mode, ... (derived)."""
    settings.add_arguments(parser, ProxyConfig)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return settings.from_args(ProxyConfig, args)


def config_argv(config: ProxyConfig) -> list[str]:
    """The command line that `python -m kvconnectors.integration.proxy` parses back into `config`."""
    return settings.to_argv(config)
