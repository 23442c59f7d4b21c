"""TieredConnector settings, read from `kv_connector_extra_config` and validated at start-up.

Each setting is declared once below: its type and range (checked by kvconnectors/settings.py),
its default, and a one-line doc; tiered/README.md's table says more. A bad value fails engine
start-up with an error naming the key and the value; unknown keys are rejected too, with the
closest known key, because a typo silently ignored is a setting silently lost.
"""

from __future__ import annotations

import ipaddress
import os
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvconnectors import settings
from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger
from kvconnectors.store.config import Dirs, Seconds, Size
from kvconnectors.store.sizes import size_setting
from kvconnectors.transport.exposure import check_exposure, is_loopback, is_wildcard

logger = get_logger(__name__)
Transport = Literal["tcp", "shm", "nixl"]
TransferMode = Literal["pull", "push"]
FailurePolicy = Literal["fail", "recompute", "retry"]
Piecewise = Literal["auto", "on", "off"]
WireProtection = Literal["handshake", "aead"]  # transport/wire.py PROTECTIONS
TRANSPORTS: tuple[str, ...] = typing.get_args(Transport)
TRANSFER_MODES: tuple[str, ...] = typing.get_args(TransferMode)
FAILURE_POLICIES: tuple[str, ...] = typing.get_args(FailurePolicy)

Host = Annotated[str, Meta(min_length=1, extra={settings.EXPECT: "a host name or IP address"})]
Port = Annotated[int, Meta(ge=0, le=65535, extra={settings.EXPECT: "an integer port in [0, 65535] (0 = any free)"})]


def _doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


class TieredConfig(msgspec.Struct, dict=True):  # dict=True: room for the derived `fault_plan`
    transport: Annotated[Transport, _doc("data path")] = "tcp"
    transfer_mode: Annotated[TransferMode, _doc("pull | push; a request may choose with kv_transfer_params")] = "pull"
    layer_group_size: Annotated[int, _doc("push: layers per message, sent while later layers compute",
                                          ge=1)] = 4
    layerwise_min_tokens: Annotated[int, _doc("push: shorter prompts go in one message after the last layer",
                                              ge=0)] = 256
    bind_host: Annotated[Host, _doc("address the producer's store server binds")] = "127.0.0.1"
    advertise_host: Annotated[Host | None, _doc("address put in tickets; default bind_host")] = None
    store_port: Annotated[Port, _doc("store server port; rank r uses store_port + r")] = 0
    lease_ttl_s: Annotated[Seconds, _doc("lease on every staged entry")] = 30.0
    heartbeat_interval_s: Annotated[Seconds | None, _doc("consumer lease renewal; default lease_ttl_s / 3")] = None
    dram_bytes: Annotated[Size, _doc("DRAM arena of the store, preallocated once")] = "1g"
    nvme_dirs: Annotated[Dirs, _doc("NVMe tier directories; must exist unless nvme_create_dirs")] = []
    nvme_bytes: Annotated[Size, _doc("NVMe budget over all directories; 0 disables the tier")] = 0
    nvme_create_dirs: Annotated[bool, _doc("create missing nvme_dirs instead of refusing them")] = False
    load_timeout_s: Annotated[Seconds, _doc("deadline of one request's pull")] = 30.0
    connect_timeout_s: Annotated[Seconds, _doc("deadline to connect and authenticate to a producer")] = 5.0
    checksum: Annotated[bool, _doc("xxh3 per block at staging, verified on receipt")] = True
    secret_file: Annotated[str | None, _doc("file holding the shared secret (owner-readable only)")] = None
    allowed_peers: Annotated[list[str] | None, _doc(
        "CIDRs a ticket's producer addresses and a push_target must fall in; default: loopback and this "
        "host's own interface subnets")] = None
    allow_insecure: Annotated[bool, _doc(
        "permit a bind_host other hosts can reach (not loopback) without a shared secret: the network is "
        "trusted")] = False
    wire_protection: Annotated[WireProtection, _doc(
        "handshake: the secret authenticates the handshake only; aead: every frame and KV byte after it is "
        "sealed (AES-256-GCM; needs the secret, v4 peers with the same setting, transport tcp or shm)")] = "handshake"
    allow_previous_wire: Annotated[bool, _doc(
        "admit peers of the previous wire version v3 (a rolling upgrade of a pool without a shared secret: v3 "
        "has no transfer tokens and its server proves nothing); refused beside a secret. Set it back to false "
        "once the whole pool is upgraded")] = False
    server_idle_timeout_s: Annotated[Seconds, _doc("store server: close a connection idle this long")] = 300.0
    server_handshake_timeout_s: Annotated[Seconds, _doc(
        "store server: a connection must finish its handshake (and prove the secret) this soon after accept")] = 2.0
    server_max_connections: Annotated[int, _doc(
        "store server: open connections in all; when reached, the one idle longest (unauthenticated first) "
        "makes room, and only when every one is busy is a newcomer refused", ge=1)] = 256
    server_max_per_peer: Annotated[int, _doc(
        "store server: open connections of one address (an IPv6 /64)", ge=1)] = 64
    server_max_pending: Annotated[int, _doc(
        "store server: connections still in their handshake, in all; half of it per address and per prefix "
        "(IPv4 /24, IPv6 /48). When reached, the one waiting longest is closed: peers that authenticate pass "
        "through in milliseconds", ge=2)] = 64
    max_concurrent_loads: Annotated[int, _doc("pull threads per worker", ge=1)] = 4
    idle_wait_s: Annotated[float, _doc(
        "consumer: an engine step that schedules no tokens while loads are in flight waits up to this long "
        "for one to finish (returns as soon as one does) instead of spinning the engine; 0 = never wait",
        ge=0, le=1)] = 0.02
    instance_name: Annotated[str, _doc("prefix of store files")] = "kvc"
    failure_policy: Annotated[FailurePolicy | None,
                              _doc("fail | recompute | retry; None = vLLM's kv_load_failure_policy")] = None
    retries: Annotated[int, _doc("attempts after the first, for failure_policy 'retry'", ge=0, le=10)] = 3
    retry_backoff_s: Annotated[Seconds, _doc("first back-off, doubled each attempt")] = 0.1
    fault_injection: Annotated[list[dict] | None, _doc("tests and chaos runs only; see transport/faults.py")] = None
    test_hooks: Annotated[bool, _doc("tests only: honour per-request kvc_fault (transport/tamper.py)")] = False
    cudagraph_piecewise: Annotated[Piecewise, _doc(
        "CUDA graphs: on = force PIECEWISE (per-layer hooks run), off = keep full graphs, auto = on for "
        "push mode; set off on push-mode decode instances")] = "auto"

    def __post_init__(self) -> None:
        settings.check_fields(self)  # types and ranges as declared above
        _host("bind_host", self.bind_host)
        if self.advertise_host is None:
            if is_wildcard(self.bind_host):
                raise ConfigError("advertise_host", None, (
                    f"must be set when bind_host is the wildcard {self.bind_host!r} (an unspecified address: every "
                    "interface): consumers need an address they can reach"))
            self.advertise_host = self.bind_host
        else:
            _host("advertise_host", self.advertise_host)
        if self.allowed_peers is not None:
            from kvconnectors.transport.peers import parse_networks

            parse_networks(self.allowed_peers)
        self._check_exposure()  # any transport: a bind that is not loopback needs a secret or allow_insecure
        self._check_protection()
        self._check_previous_wire()
        if self.heartbeat_interval_s is None:
            self.heartbeat_interval_s = self.lease_ttl_s / 3
        if self.heartbeat_interval_s >= self.lease_ttl_s:
            raise ConfigError("heartbeat_interval_s", self.heartbeat_interval_s,
                              f"must be shorter than lease_ttl_s ({self.lease_ttl_s}), or leases lapse between beats")
        self.dram_bytes = size_setting("dram_bytes", self.dram_bytes)
        raw_nvme = self.nvme_bytes
        self.nvme_bytes = size_setting("nvme_bytes", self.nvme_bytes, allow_zero=True)
        if self.nvme_bytes and not self.nvme_dirs:
            raise ConfigError("nvme_bytes", raw_nvme, "is set but nvme_dirs is empty")
        if self.nvme_dirs and not self.nvme_bytes:
            raise ConfigError("nvme_dirs", self.nvme_dirs, (
                "is set but nvme_bytes is 0, which turns the NVMe tier off: set nvme_bytes (the budget over all "
                "the directories, e.g. '200g'), or leave nvme_dirs out"))
        from kvconnectors.transport.faults import FaultPlan

        self.fault_plan = FaultPlan.from_config(self.fault_injection)

    @property
    def has_secret(self) -> bool:
        """A shared secret is configured: secret_file, or the environment variable (read at start)."""
        from kvconnectors.transport.auth import SECRET_ENV  # noqa: PLC0415 - config stays light to import

        return bool(self.secret_file or os.environ.get(SECRET_ENV))

    def _check_exposure(self) -> None:
        """A store server other hosts can reach (bind_host not loopback: a wildcard, however spelled,
        or any other address or host name; transport/exposure.py) without a shared secret serves any
        host that can reach it: refused unless allow_insecure says the network is trusted (the secret
        may come from the env). With transport nixl, allow_insecure does not waive it (below)."""
        from kvconnectors.transport.auth import SECRET_ENV  # noqa: PLC0415 - config stays light to import

        has_secret = self.has_secret
        _nixl_needs_secret(self.transport, self.bind_host, has_secret)
        check_exposure("bind_host", self.bind_host, has_secret=has_secret, allow_insecure=self.allow_insecure,
                       secret_how=f"secret_file, or the {SECRET_ENV} environment variable",
                       who="TieredConnector's store server")

    def _check_protection(self) -> None:
        """aead seals the connection with keys from the authenticated handshake: it needs the secret,
        and a data path on that connection (tcp) or on this host (shm); NIXL moves bytes itself."""
        if self.wire_protection != "aead":
            return
        from kvconnectors.transport.auth import SECRET_ENV  # noqa: PLC0415 - config stays light to import

        if not self.has_secret:
            raise ConfigError("wire_protection", self.wire_protection, (
                f"needs the shared secret (secret_file or {SECRET_ENV}): the sealing keys come from the handshake "
                "it authenticates"))
        if self.transport == "nixl":
            raise ConfigError("wire_protection", self.wire_protection, (
                "cannot seal transport 'nixl': NIXL moves the KV bytes itself, outside the sealed connection; use "
                "transport 'tcp' across hosts (or 'shm' on one host) with aead, or wire_protection 'handshake' "
                "on a trusted network"))

    def _check_previous_wire(self) -> None:
        """v3 authenticates one way (its server proves nothing), so a side holding the secret that
        spoke it could be downgraded by anyone who says "v3 only": never both."""
        from kvconnectors.transport.auth import SECRET_ENV  # noqa: PLC0415 - config stays light to import

        if self.allow_previous_wire and self.has_secret:
            raise ConfigError("allow_previous_wire", True, (
                f"cannot be combined with a shared secret (secret_file or {SECRET_ENV}): the previous wire version "
                "v3 authenticates one way only, so a peer that says it speaks only v3 would be trusted without "
                "proving the secret. Upgrade the pool's instances together (or per prefill/decode pair), or roll "
                "forward without a secret on a trusted network"))

    def check_role(self, kv_role: str | None) -> None:
        """What this instance's role needs. A push-mode decode runs the landing store the prefill
        streams to, at an address the proxy must be told: a random port (store_port 0) cannot be."""
        if self.transfer_mode == "push" and kv_role == "kv_consumer" and not self.store_port:
            raise ConfigError("store_port", self.store_port, (
                "must be a fixed port on a push-mode decode (kv_role kv_consumer, transfer_mode push): its landing "
                "store listens there and the proxy names it to the prefill (--decode URL,kv=HOST:PORT); 0 would "
                "pick a random port nobody can be told"))

    def check_local(self, *, create_dirs: bool = True) -> None:
        """What start-up would find on this host, checked now instead of after the model and KV cache
        are loaded: the NVMe directories (created if nvme_create_dirs, unless `create_dirs` is False:
        then a missing one that would be created is passed), the names of the store's files, the
        secret file, NIXL for transport nixl. ConfigError naming the setting and the value."""
        from kvconnectors.store.config import StoreConfig  # noqa: PLC0415 - config stays light to import
        from kvconnectors.transport.auth import load_secret  # noqa: PLC0415

        dirs = self.nvme_dirs if create_dirs or not self.nvme_create_dirs else [
            d for d in self.nvme_dirs if os.path.lexists(d)]
        # slot_bytes is the model's block size, unknown here: one byte checks everything else. The
        # store's instance_name is ours plus the rank (worker.py); its refusal names ours.
        try:
            StoreConfig(slot_bytes=1, dram_bytes=self.dram_bytes, nvme_dirs=dirs,
                        nvme_bytes=self.nvme_bytes if dirs else 0, nvme_create_dirs=self.nvme_create_dirs and create_dirs,
                        lease_ttl_s=self.lease_ttl_s, instance_name=f"{self.instance_name}0", dram_prefault=False)
        except ConfigError as exc:
            if exc.key != "instance_name":
                raise
            raise ConfigError("instance_name", self.instance_name, exc.why) from None
        if self.secret_file:
            load_secret(self.secret_file)
        if self.transport == "nixl":
            from kvconnectors.transport.nixl_agent import require_nixl  # noqa: PLC0415 - imports NIXL (~2 s)

            require_nixl()

    @property
    def compat(self) -> str | dict[int, str]:
        """What this instance's store clients present and its store servers admit: the previous
        wire version too while allow_previous_wire is on."""
        from kvconnectors.transport import wire

        return wire.compat_hashes("tiered") if self.allow_previous_wire else wire.compat_hash("tiered")

    def check_engine_policy(self, engine_policy: str) -> None:
        """vLLM applies fail/recompute engine-wide (`kv_load_failure_policy`); ours must agree."""
        if self.failure_policy in ("fail", "recompute") and self.failure_policy != engine_policy:
            raise ConfigError("failure_policy", self.failure_policy, (
                f"differs from vLLM's kv_load_failure_policy={engine_policy!r}, which decides what a failed "
                f"load does; set kv_load_failure_policy to {self.failure_policy!r} (top level of "
                "--kv-transfer-config), or use failure_policy 'retry' to retry before it applies"))

    @property
    def piecewise(self) -> bool:
        """Whether vLLM must run PIECEWISE CUDA graphs: a push producer streams layer groups from
        save_kv_layer, which a replayed full graph skips. vLLM asks before it knows the role."""
        return self.cudagraph_piecewise == "on" or (self.cudagraph_piecewise == "auto" and
                                                    self.transfer_mode == "push")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "TieredConfig":
        """From `kv_connector_extra_config`; an unknown key fails with the closest known one."""
        return settings.from_mapping(cls, extra, "TieredConnector")


def _host(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must be a host name or IP address")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not all(part and part.replace("-", "").isalnum() for part in value.split(".")):
            raise ConfigError(key, value, "is neither an IP address nor a valid host name") from None


def _nixl_needs_secret(transport: str, bind_host: str, has_secret: bool) -> None:
    """transport "nixl" reachable from other hosts needs the shared secret (issue 16, finding 5),
    allow_insecure or not: the general rule (check_exposure) with a stronger reason, so its own
    message. NIXL cannot limit a peer to one entry: the agent metadata a nixl ReadReply carries lets
    its holder READ and WRITE the producer's whole registered arena (README, Security). So that
    metadata may go only to authenticated peers: with bind_host not a loopback address, a secret
    (secret_file or the KVCONNECTORS_SECRET variable) must be configured."""
    if transport != "nixl" or is_loopback(bind_host) or has_secret:
        return
    from kvconnectors.transport.auth import SECRET_ENV  # noqa: PLC0415 - config stays light to import

    raise ConfigError("secret_file", None, (
        f"must be set (or {SECRET_ENV}) with transport 'nixl' and bind_host {bind_host!r}, which is not a "
        "loopback address: the NIXL agent metadata a producer hands each consumer lets it READ and WRITE the "
        "whole registered arena, other requests' KV included, so only authenticated peers may get it "
        "(README, Security)"))

