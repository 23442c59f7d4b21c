"""TieredConnectorBackend: Ray Serve LLM's connector backend for TieredConnector. Ray imports it in each
replica by the path that kvconnectors.ray registers (BACKEND_PATH).

Ray runs `setup()` in every prefill and decode replica before it builds the engine, and the decode
replica (Ray's P/D orchestrator) calls `prepare_prefill_request` / `prepare_decode_request` per
request. The shaping is our proxy's (integration/proxy/app.py): the prefill leg gets max_tokens 1,
no stream and `do_remote_decode`; the client's own kv_transfer_params never reach an engine; the
decode leg gets the ticket the prefill returned, and no ticket is an error, not a silent recompute.
Push mode (decode's transfer_mode "push"): the prefill leg also carries this decode replica's
landing store as push_target. Like the proxy's --forward-kv-params, the decode config's
`experimental_configs: {kvconnectors_forward_kv_params: [KEY, ...]}` lets those keys of the client's
kv_transfer_params through to the prefill leg (none by default; our keys always win); transfer-plane
keys (push_target, transfer_mode, kvc*) also need `kvconnectors_unlock_transfer_keys: true`, for tests
and chaos runs only (the proxy's rule: integration/proxy/config.py check_forwarded_keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend, clamp_request_to_single_token

from kvconnectors import serving
from kvconnectors.errors import ConfigError
from kvconnectors.integration.proxy import check_forwarded_keys, prefill_kv_params  # as our proxy does
from kvconnectors.integration.ray import stores
from kvconnectors.logs import get_logger

if TYPE_CHECKING:
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

logger = get_logger(__name__)

FORWARD_KV_PARAMS = "kvconnectors_forward_kv_params"  # keys of LLMConfig.experimental_configs
UNLOCK_TRANSFER_KEYS = "kvconnectors_unlock_transfer_keys"


def forwarded_keys(experimental: Any) -> tuple[str, ...]:
    """The client kv_transfer_params keys an operator lets through (experimental_configs); transfer-plane
    keys only with the unlock key set to true."""
    experimental = experimental or {}
    keys = experimental.get(FORWARD_KV_PARAMS, ())
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"experimental_configs.{FORWARD_KV_PARAMS}", keys, "must be a list of key names")
    unlocked = experimental.get(UNLOCK_TRANSFER_KEYS, False)
    if not isinstance(unlocked, bool):
        raise ConfigError(f"experimental_configs.{UNLOCK_TRANSFER_KEYS}", unlocked, "must be true or false")
    check_forwarded_keys(keys, setting=f"experimental_configs.{FORWARD_KV_PARAMS}", unlocked=unlocked,
                         unlock=f"experimental_configs.{UNLOCK_TRANSFER_KEYS} is true")
    return tuple(keys)


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def node_address() -> str:
    """This replica's node address as the cluster knows it (`ray start --node-ip-address`): the one
    other nodes reach. `ray.util.get_node_ip_address()` in a worker is instead the source address of
    the route to the internet: another interface on a multi-homed host, loopback where no such route
    exists (seen on a two-node cluster in network namespaces)."""
    if ray.is_initialized():
        node_id = _node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("Alive", True):
                return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class TieredConnectorBackend(BaseConnectorBackend):
    # Sequential handoff without peer binding, in push mode too: the decode learns the transfer
    # id and token from the prefill's response, and the push target is the decode itself.
    requires_peer_binding = False
    concurrent_handoff = False

    def __init__(self, llm_config: "LLMConfig") -> None:
        super().__init__(llm_config)
        self.push_target: str | None = None
        self.secret_source: str | None = None
        self.forward_kv_params = forwarded_keys(getattr(llm_config, "experimental_configs", None))
        self._warned_client_params = False

    def setup(self) -> None:
        ktc = self.kv_transfer_config
        extra = ktc.get("kv_connector_extra_config")
        if extra is None:
            extra = ktc["kv_connector_extra_config"] = {}  # in place: the engine reads this same dict
        elif not isinstance(extra, dict):
            raise ConfigError("kv_connector_extra_config", extra, "must be a mapping")
        tp = int(self.llm_config.engine_kwargs.get("tensor_parallel_size", 1) or 1)
        plan = stores.plan(extra, kv_role=ktc.get("kv_role"), node_ip=node_address(), tp_size=tp,
                           port_offset=self._compute_port_offset,
                           free_ports=lambda n, host: serving.free_port_block(n, host))
        extra.update(plan.updates)
        self.push_target = plan.push_target
        self.secret_source = stores.secret_source(extra)
        from kvconnectors.tiered.config import TieredConfig  # noqa: PLC0415

        TieredConfig.from_extra(extra)  # a bad key fails this replica now, with its name
        logger.info("TieredConnector on Ray: %s store %s:%s%s, secret from %s", ktc.get("kv_role"),
                    extra.get("advertise_host") or extra.get("bind_host"), extra.get("store_port", 0) or "(kernel's)",
                    f", push target {self.push_target}" if self.push_target else "", self.secret_source or "nowhere")

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        theirs = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        dropped = sorted(k for k in theirs if k not in self.forward_kv_params)
        if dropped and not self._warned_client_params:
            self._warned_client_params = True  # as our proxy: a client does not steer the transfer plane
            logger.warning("kv_transfer_params from the client dropped (keys %s): the P/D orchestrator sets them "
                           "(experimental_configs.%s lets named keys through)", dropped, FORWARD_KV_PARAMS)
        shaped = request.model_copy(deep=True)
        shaped.kv_transfer_params = prefill_kv_params(theirs, self.forward_kv_params, self.push_target)
        clamp_request_to_single_token(shaped)
        if getattr(shaped, "min_tokens", 0):
            shaped.min_tokens = 0  # vLLM refuses min_tokens > max_tokens (1)
        return shaped

    def prepare_decode_request(self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any) -> Any:
        if prefill_response is None:
            raise ValueError("prefill_response=None: TieredConnector hands off sequentially; the decode needs the "
                             "prefill's ticket (concurrent_handoff must stay False)")
        ticket = getattr(prefill_response, "kv_transfer_params", None)
        if not isinstance(ticket, dict) or not ticket:
            raise ValueError(f"prefill response kv_transfer_params={ticket!r}: the prefill engine returned no "
                             "ticket (is it running TieredConnector with kv_role kv_producer?); refusing to "
                             "decode without the KV transfer")
        shaped = request.model_copy(deep=True)
        shaped.kv_transfer_params = dict(ticket)
        return shaped
