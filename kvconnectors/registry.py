"""Registration of our connectors with vLLM, and what every vLLM process running them needs.

`register_with_vllm` is the `vllm.general_plugins` entry point, which vLLM calls in every
process (API server, engine core, workers); after `pip install kvconnectors` the connector
is usable by name alone: `{"kv_connector": "TieredConnector", ...}`. It also runs
`setup_process`, which the connector module runs too when it is loaded by
`kv_connector_module_path` from a checkout that is not installed (no entry point then).
In a process that already runs Ray (a Ray Serve LLM replica) it also registers our Ray connector
backend (kvconnectors/ray/); it never imports Ray itself, which costs ~1.5 s.
"""

from __future__ import annotations

import multiprocessing
import sys

from kvconnectors import logs
from kvconnectors.tiered import client_errors

logger = logs.get_logger(__name__)

CONNECTORS: dict[str, tuple[str, str]] = {
    "TieredConnector": ("kvconnectors.tiered.connector", "TieredConnector"),
}


def setup_process() -> None:
    """Once per vLLM process (idempotent; never raises, vLLM does not guard its plugins): our log
    records go through vLLM's logging (logs.py), and a failed KV load's cause reaches the HTTP
    client's error (tiered/client_errors.py; the patch only acts in the API server)."""
    logs.use_vllm_logging()
    # The API server is the process vLLM starts first; its engine core and workers are multiprocessing
    # children, where the patch would only cost an import of the API-server modules (~0.8 s each).
    if multiprocessing.parent_process() is None:
        client_errors.install()


def register_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    setup_process()
    for name, (module, cls) in CONNECTORS.items():
        if name in KVConnectorFactory._registry:  # plugins load once per process, but be safe
            continue
        KVConnectorFactory.register_connector(name, module, cls)
    register_with_ray()


def register_with_ray() -> None:
    """Our Ray Serve LLM backend, only in a process connected to Ray (a Serve replica): no cost
    elsewhere (an engine core child may import Ray without running it; registering there would
    reach no one), and never raises (vLLM does not guard its plugins). Ray looks backends up before
    vLLM loads plugins, so this covers replicas started later; kvconnectors.ray says what covers the
    first ones."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return
    try:
        from kvconnectors.ray import register_backend  # noqa: PLC0415

        register_backend()
    except Exception:
        logger.warning("could not register TieredConnector's Ray Serve LLM backend", exc_info=True)
