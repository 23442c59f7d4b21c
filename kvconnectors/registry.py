"""Registration of our connectors with vLLM's connector factory.

`register_with_vllm` is the `vllm.general_plugins` entry point, which vLLM calls in every
process (API server, engine core, workers); after `pip install kvconnectors` the connector
is usable by name alone: `{"kv_connector": "TieredConnector", ...}`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTORS: dict[str, tuple[str, str]] = {
    "TieredConnector": ("kvconnectors.tiered.connector", "TieredConnector"),
}


def register_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, (module, cls) in CONNECTORS.items():
        if name in KVConnectorFactory._registry:  # plugins load once per process, but be safe
            continue
        KVConnectorFactory.register_connector(name, module, cls)
