"""TieredConnector under Ray Serve LLM: the registration of its connector backend with Ray.

The backend itself (requests shaped as our proxy shapes them; each replica's store address, ports
and secret) is Ray Serve integration code: integration/ray/backend.py and stores.py. This module only
names it, by a path Ray imports in each replica (BACKEND_PATH), so the package never imports the
integration folder. It stays in the package because the vLLM plugin (kvconnectors.registry) calls it,
and `build_pd_openai_app`, the import path users' Serve configs name, needs nothing but it.

Ray Serve LLM shapes the prefill and decode requests of its P/D app (`build_pd_openai_app`) through a
*connector backend* looked up by the `kv_connector` name in Ray's factory
(`ray.llm._internal.serve.engines.vllm.kv_transfer.factory.KVConnectorBackendFactory`). An unknown
name gets Ray's DefaultConnectorBackend with the warning "Unsupported connector backend". Ray looks
the name up in `VLLMEngine.__init__` of each replica, before that replica builds its vLLM engine
args, which is when vLLM loads our `vllm.general_plugins` entry point: the plugin alone is too late
for the replica it runs in. The registry lives in Ray's cluster-wide KV store, so one registration
anywhere in the cluster before the replicas start is enough. This module does that:

* `import kvconnectors.ray` (a driver, before or after `ray.init`: Ray queues and flushes it);
* `import_path: kvconnectors.ray:build_pd_openai_app` in a Serve config: registers in the build
  task, before Serve creates any replica, then calls Ray's own builder (integration/ray/);
* the vLLM plugin (kvconnectors.registry), in processes that already run Ray: later replicas.

`register_backend` is idempotent and returns False, never raising, when Ray is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from kvconnectors.logs import get_logger

if TYPE_CHECKING:
    from ray.serve.deployment import Application

logger = get_logger(__name__)

BACKEND_NAME = "TieredConnector"  # the kv_connector value Ray looks up
# A path, not the class: the registry pickles what it gets into Ray's KV store; replicas import it.
BACKEND_PATH = "kvconnectors.integration.ray.backend:TieredConnectorBackend"
FACTORY_MODULE = "ray.llm._internal.serve.engines.vllm.kv_transfer.factory"

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "build_pd_openai_app", "ray_installed", "register_backend"]


def ray_installed() -> bool:
    """Whether Ray can be imported here (a look at the import system; does not import Ray)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] without a __spec__: treat as absent
        return False


def register_backend() -> bool:
    """Register TieredConnectorBackend with Ray's factory. True when it is registered (by this call
    or an earlier one, in this process or anywhere in the cluster); False when Ray or its LLM part is
    not installed. Safe to call any number of times, from any number of replicas at once."""
    if not ray_installed():
        return False
    try:
        factory = importlib.import_module(FACTORY_MODULE).KVConnectorBackendFactory
    except ImportError as exc:  # Ray without ray[serve]/its LLM dependencies
        logger.debug("Ray Serve LLM not importable (%s); TieredConnector's Ray backend not registered", exc)
        return False
    if factory.is_registered(BACKEND_NAME):
        return True
    try:
        factory.register_backend(BACKEND_NAME, BACKEND_PATH)
    except ValueError:
        # Ray refuses a second registration; another replica may have won the race since our check.
        if not factory.is_registered(BACKEND_NAME):
            raise
    return True


def build_pd_openai_app(pd_serving_args: dict) -> "Application":
    """Ray's `ray.serve.llm.build_pd_openai_app`, after registering our backend: use it as a Serve
    config's `import_path` so no replica ever starts before the registration."""
    if not register_backend():
        raise ImportError("kvconnectors.ray.build_pd_openai_app needs Ray Serve LLM: pip install 'kvconnectors[ray]'")
    from ray.serve.llm import build_pd_openai_app as build  # noqa: PLC0415 - Ray is optional

    return build(pd_serving_args)


def _register_on_import() -> None:
    try:
        register_backend()
    except Exception:  # an import must not fail because Ray's registry did
        logger.warning("could not register TieredConnector's Ray Serve LLM backend", exc_info=True)


_register_on_import()
