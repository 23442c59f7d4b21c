"""TieredConnector's Ray Serve LLM backend against Ray's real classes, no cluster: registration
(kvconnectors/ray/), request shaping (pull, push), addresses, ports, the secret (integration/ray/backend.py,
stores.py); the ray extra; the Serve config and the KubeRay manifests (integration/ray/)."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

ray = pytest.importorskip("ray")  # the ray extra; CI installs it (./dev setup)

from packaging.requirements import Requirement  # noqa: E402
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig  # noqa: E402
from ray.llm._internal.serve.core.configs.openai_api_models import (  # noqa: E402
    ChatCompletionRequest, CompletionRequest)
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend  # noqa: E402
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory as Factory  # noqa: E402
from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs  # noqa: E402
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDOrchestratorMixin  # noqa: E402

import kvconnectors.ray as kray  # noqa: E402
from kvconnectors import registry, serving  # noqa: E402
from kvconnectors.errors import ConfigError  # noqa: E402
from kvconnectors.integration.ray import backend as kbackend  # noqa: E402
from kvconnectors.integration.ray import manifests  # noqa: E402
from kvconnectors.transport.auth import SECRET_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NODE_IP = "192.0.2.7"  # TEST-NET-1: never reached, only advertised
SECRET = "ray-backend-test-secret-7c1f9e2a"  # 16+ bytes, 8+ distinct values (transport/auth.py)


@pytest.fixture(autouse=True)
def backend_registered():
    """Each test starts and ends with our backend registered (some unregister it)."""
    kray.register_backend()
    yield
    kray.register_backend()


@pytest.fixture(autouse=True)
def node_ip(monkeypatch):
    """The node's address, and the shared secret in the replica's environment (as the Serve config's
    runtime_env or the KubeRay manifests put it): a store on the node's IP without one is refused."""
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: NODE_IP)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    return NODE_IP


def serve_args() -> dict[str, Any]:
    return manifests.load(manifests.SERVE_CONFIG)["applications"][0]["args"]


def llm_config(role: str, **extra: Any) -> LLMConfig:
    """One of the Serve config's LLM configs, as Ray builds it, its extra config updated."""
    cfg = serve_args()[f"{role}_config"]
    cfg["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"].update(extra)
    return LLMConfig.model_validate(cfg)


def set_up(role: str, **extra: Any) -> tuple[LLMConfig, kbackend.TieredConnectorBackend]:
    """Ray's own path: LLMConfig.setup_engine_backend() (what VLLMEngine.__init__ calls) looks the
    backend up in the factory, instantiates it with the config and runs setup()."""
    cfg = llm_config(role, **extra)
    cfg.setup_engine_backend()
    backend = cfg.kv_connector_backend
    assert isinstance(backend, kbackend.TieredConnectorBackend)
    return cfg, backend


def extra_of(cfg: LLMConfig) -> dict[str, Any]:
    return cfg.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]


def orchestrator(cfg: LLMConfig) -> Any:
    """Ray's P/D orchestrator mixin on a decode config, without a replica."""
    return types.SimpleNamespace(_llm_config=cfg, _get_connector_backend=lambda: cfg.kv_connector_backend)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="hello there", **{"max_tokens": 16, **kw})


# ---------------------------------------------------------------------------------- registration
def test_ray_finds_our_backend_by_name():
    assert Factory.is_registered("TieredConnector")
    assert Factory.get_backend_class("TieredConnector") is kbackend.TieredConnectorBackend
    assert issubclass(kbackend.TieredConnectorBackend, BaseConnectorBackend)


def test_register_backend_is_idempotent_and_survives_a_race(monkeypatch):
    assert [kray.register_backend() for _ in range(3)] == [True, True, True]
    # Another replica registered between our check and our call: Ray raises ValueError; that is fine.
    calls: list[str] = []
    monkeypatch.setattr(Factory, "is_registered", classmethod(lambda cls, name: calls.append(name) or len(calls) > 1))
    assert kray.register_backend() is True


def test_plugin_registers_in_a_process_running_ray(monkeypatch):
    Factory.unregister_backend("TieredConnector")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    registry.register_with_ray()  # an engine core child that imported Ray but runs none: nothing
    assert not Factory.is_registered("TieredConnector")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    registry.register_with_ray()
    assert Factory.get_backend_class("TieredConnector") is kbackend.TieredConnectorBackend


def test_builder_registers_before_ray_builds(monkeypatch):
    import ray.serve.llm

    Factory.unregister_backend("TieredConnector")
    seen: list[bool] = []
    monkeypatch.setattr(ray.serve.llm, "build_pd_openai_app",
                        lambda args: seen.append(Factory.is_registered("TieredConnector")) or "app")
    assert kray.build_pd_openai_app({}) == "app"
    assert seen == [True]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_ray_nothing_fails():
    r = run_python(
        "import sys; sys.modules['ray'] = None\n"  # Ray absent: its import fails
        "import kvconnectors.ray as k\n"
        "assert k.ray_installed() is False and k.register_backend() is False\n"
        "from kvconnectors import registry; registry.register_with_ray()\n"
        "try:\n    k.build_pd_openai_app({})\nexcept ImportError as e:\n    assert 'kvconnectors[ray]' in str(e)\n"
        "else:\n    raise AssertionError('no ImportError')\n")
    assert r.returncode == 0, r.stderr


def test_ray_without_its_llm_part_is_absent_too():
    r = run_python("import sys; sys.modules['ray.llm'] = None\n"  # ray without ray[serve]'s LLM dependencies
                   "import kvconnectors.ray as k\nassert k.ray_installed() and k.register_backend() is False\n")
    assert r.returncode == 0, r.stderr


def test_plugin_never_imports_ray():
    r = run_python("import sys\nfrom kvconnectors import registry\nregistry.register_with_ray()\n"
                   "assert 'ray' not in sys.modules, 'the plugin imported Ray'\n")
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- request shaping
def test_pull_prefill_request_is_our_proxys(caplog):
    from kvconnectors.integration.proxy import PREFILL_KV_PARAMS

    cfg, backend = set_up("decode")
    assert backend.push_target is None
    request = completion(stream=True, stream_options={"include_usage": True}, min_tokens=4,
                         kv_transfer_params={"push_target": "203.0.113.9:1"})
    shaped = PDOrchestratorMixin._prepare_prefill_request(orchestrator(cfg), request)
    assert shaped.kv_transfer_params == PREFILL_KV_PARAMS
    assert (shaped.max_tokens, shaped.stream, shaped.stream_options, shaped.min_tokens) == (1, False, None, 0)
    assert (request.max_tokens, request.stream, request.min_tokens) == (16, True, 4)  # the client's stays
    assert "kv_transfer_params from the client dropped" in caplog.text


def test_named_client_kv_params_reach_the_prefill_and_ours_win(caplog):
    """experimental_configs.kvconnectors_forward_kv_params, like the proxy's --forward-kv-params."""
    from kvconnectors.integration.proxy import PREFILL_KV_PARAMS

    raw = serve_args()["decode_config"]
    raw["experimental_configs"] = {kbackend.FORWARD_KV_PARAMS: ["kvc_fault", "do_remote_decode"],
                                   kbackend.UNLOCK_TRANSFER_KEYS: True}  # kvc_fault: a transfer-plane key
    cfg = LLMConfig.model_validate(raw)
    cfg.setup_engine_backend()
    request = completion(kv_transfer_params={"kvc_fault": "corrupt", "do_remote_decode": False, "push_target": "x"})
    shaped = PDOrchestratorMixin._prepare_prefill_request(orchestrator(cfg), request)
    assert shaped.kv_transfer_params == {**PREFILL_KV_PARAMS, "kvc_fault": "corrupt"}
    assert "dropped (keys ['push_target'])" in caplog.text
    raw["experimental_configs"] = {kbackend.FORWARD_KV_PARAMS: "kvc_fault"}
    with pytest.raises(ConfigError, match="experimental_configs.kvconnectors_forward_kv_params"):
        LLMConfig.model_validate(raw).setup_engine_backend()


def test_chat_prefill_request_is_clamped():
    cfg, _ = set_up("decode")
    chat = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                 max_completion_tokens=9, stream=True)
    shaped = PDOrchestratorMixin._prepare_prefill_request(orchestrator(cfg), chat)
    assert (shaped.max_tokens, shaped.max_completion_tokens, shaped.stream) == (1, 1, False)
    assert shaped.kv_transfer_params["do_remote_decode"] is True


def test_decode_request_carries_the_ticket_and_refuses_none():
    cfg, _ = set_up("decode")
    ticket = {"do_remote_prefill": True, "kvc": {"v": 3, "tid": "e:r"}}
    shaped = PDOrchestratorMixin._prepare_decode_request(
        orchestrator(cfg), completion(stream=True), types.SimpleNamespace(kv_transfer_params=ticket))
    assert shaped.kv_transfer_params == ticket and shaped.stream and shaped.max_tokens == 16
    for response in (types.SimpleNamespace(kv_transfer_params=None), types.SimpleNamespace(kv_transfer_params={})):
        with pytest.raises(ValueError, match="kv_transfer_params="):
            PDOrchestratorMixin._prepare_decode_request(orchestrator(cfg), completion(), response)
    with pytest.raises(ValueError, match="prefill_response=None"):
        cfg.kv_connector_backend.prepare_decode_request(request=completion(), peer=None, prefill_response=None)


def test_push_prefill_request_names_this_decodes_landing_store(monkeypatch):
    from kvconnectors.integration.proxy import PREFILL_KV_PARAMS

    asked: list[tuple[int, str]] = []
    monkeypatch.setattr(serving, "free_port_block", lambda n, host: asked.append((n, host)) or 7345)
    cfg, backend = set_up("decode", transfer_mode="push")
    assert asked == [(1, NODE_IP)]  # bound where it is advertised
    assert extra_of(cfg)["store_port"] == 7345 and backend.push_target == f"{NODE_IP}:7345"
    shaped = PDOrchestratorMixin._prepare_prefill_request(orchestrator(cfg), completion())
    assert shaped.kv_transfer_params == {**PREFILL_KV_PARAMS, "transfer_mode": "push",
                                         "push_target": f"{NODE_IP}:7345"}
    assert backend.requires_peer_binding is False and backend.concurrent_handoff is False


# ------------------------------------------------------------------------ addresses and ports
def test_stores_advertise_the_node_ip():
    cfg, backend = set_up("prefill")
    assert extra_of(cfg)["bind_host"] == NODE_IP and "store_port" not in extra_of(cfg)  # the kernel's port
    assert backend.push_target is None
    cfg, _ = set_up("prefill", bind_host="0.0.0.0", allow_insecure=True)
    assert (extra_of(cfg)["bind_host"], extra_of(cfg)["advertise_host"]) == ("0.0.0.0", NODE_IP)
    cfg, _ = set_up("prefill", bind_host="127.0.0.1")  # an explicit address is the user's
    assert extra_of(cfg)["bind_host"] == "127.0.0.1" and "advertise_host" not in extra_of(cfg)


def test_store_address_is_the_nodes_as_the_cluster_knows_it(monkeypatch):
    """In a replica: the address its node registered (ray start --node-ip-address), not the source
    address of the route to the internet that ray.util.get_node_ip_address() gives a worker."""
    import ray

    nodes = [{"NodeID": "n1", "Alive": True, "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "n2", "Alive": True, "NodeManagerAddress": "10.0.0.2"}]
    # Ray as a connected replica sees it, for the backend module only (the rest of Ray stays offline)
    monkeypatch.setattr(kbackend, "ray", types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: nodes,
                                                               util=ray.util))
    monkeypatch.setattr(kbackend, "_node_id", lambda: "n2")
    cfg, _ = set_up("prefill")
    assert extra_of(cfg)["bind_host"] == "10.0.0.2"


def test_push_landing_ports_differ_between_replicas():
    ports = []
    for _ in range(2):
        cfg, backend = set_up("decode", transfer_mode="push", bind_host="127.0.0.1")
        ports.append(extra_of(cfg)["store_port"])
        assert backend.push_target == f"127.0.0.1:{ports[-1]}"
    assert ports[0] != ports[1]
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free until the engine binds it


@pytest.mark.parametrize(("tp", "rank", "port"), [(1, 0, 7300), (1, 2, 7302), (2, 2, 7304)])
def test_a_set_store_port_is_a_base_offset_by_replica_rank(monkeypatch, tp, rank, port):
    import ray.serve

    monkeypatch.setattr(ray.serve, "get_replica_context",
                        lambda: types.SimpleNamespace(rank=types.SimpleNamespace(rank=rank)))
    cfg = llm_config("prefill", store_port=7300)
    cfg.engine_kwargs["tensor_parallel_size"] = tp
    cfg.setup_engine_backend()  # Ray's _compute_port_offset: rank x tp x pp
    assert extra_of(cfg)["store_port"] == port


def test_bad_config_fails_the_replica_naming_the_field():
    with pytest.raises(ConfigError, match="store_port"):
        set_up("prefill", store_port="7100")
    with pytest.raises(ConfigError, match="kv_role"):
        cfg = llm_config("prefill")
        cfg.engine_kwargs["kv_transfer_config"]["kv_role"] = None
        cfg.setup_engine_backend()
    with pytest.raises(ValueError, match="dram_byte"):  # TieredConfig's own check, at replica start
        set_up("prefill", dram_byte="1g")


# -------------------------------------------------------------------------------------- secret
def test_secret_from_the_replicas_environment(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)  # runtime_env env_vars / the node's environment
    assert set_up("prefill")[1].secret_source == f"env {SECRET_ENV}"
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        set_up("prefill")


def test_secret_file_must_reach_the_replica(tmp_path):
    path = tmp_path / "secret"  # (the file wins over the environment's secret)
    with pytest.raises(ConfigError, match="secret_file"):
        set_up("prefill", secret_file=str(path))  # not mounted on this node
    path.write_text(SECRET)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        set_up("prefill", secret_file=str(path))
    path.chmod(0o600)
    assert set_up("prefill", secret_file=str(path))[1].secret_source == f"secret_file {path}"


def test_no_secret_on_a_node_address_is_refused_unless_allow_insecure(monkeypatch, caplog):
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError) as exc:  # issue 34 item 5: refused, no longer only warned about
        set_up("prefill")
    assert "bind_host" in exc.value.key and SECRET_ENV in exc.value.why and "allow_insecure" in exc.value.why
    assert set_up("prefill", allow_insecure=True)[1].secret_source is None
    assert "without a shared secret" in caplog.text
    assert set_up("prefill", bind_host="127.0.0.1")[1].secret_source is None  # loopback: nothing to refuse


# --------------------------------------------------------------------------- the ray extra
def setup_py_literal(name: str) -> Any:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_ray_extra_is_rays_llm_extra_without_its_engine():
    from importlib.metadata import requires, version

    assert version("ray") == setup_py_literal("RAY_VERSION")
    excluded = set(setup_py_literal("RAY_LLM_EXCLUDED"))
    theirs = []
    for line in requires("ray"):
        req = Requirement(line)
        if req.marker is not None and 'extra == "llm"' in str(req.marker):  # all Pythons' lines, not just ours
            if req.name not in excluded:
                theirs.append(str(req).replace(' and extra == "llm"', "").replace('; extra == "llm"', ""))
    ours = setup_py_literal("RAY_LLM")
    assert sorted(map(str, map(Requirement, ours))) == sorted(map(str, map(Requirement, theirs)))
    assert not {Requirement(r).name for r in ours} & {"vllm", "nixl", "nixl-cu13"}


# -------------------------------------------------------------------- Serve config, manifests
def test_serve_config_is_valid_for_ray():
    config = manifests.load(manifests.SERVE_CONFIG)
    app = config["applications"][0]
    from ray._common.utils import import_attr

    assert import_attr(app["import_path"]) is kray.build_pd_openai_app  # no user import needed
    pd = PDServingArgs.model_validate(app["args"])
    for cfg, role in ((pd.prefill_config, "kv_producer"), (pd.decode_config, "kv_consumer")):
        cfg.get_engine_config()  # Ray refuses unknown engine arguments here
        ktc = cfg.engine_kwargs["kv_transfer_config"]
        assert (ktc["kv_connector"], ktc["kv_role"]) == ("TieredConnector", role)
        assert ktc["kv_connector_extra_config"].get("transfer_mode", "pull") == "pull"
        assert cfg.placement_group_config["bundles"] == [{"CPU": 1}]
    envs = [app.get("runtime_env", {})] + [app["args"][n].get("runtime_env", {}) for n in manifests.LLM_CONFIGS]
    assert not any(SECRET_ENV in e.get("env_vars", {}) for e in envs)  # no secret in the repository


def test_rayservice_cpu_variant_is_the_serve_config():
    manifest = manifests.render("cpu")
    assert manifests.serve_config(manifest) == manifests.load(manifests.SERVE_CONFIG)
    for c in manifests.containers(manifest):
        env = {e["name"]: e for e in c["env"]}
        assert env[SECRET_ENV]["valueFrom"]["secretKeyRef"]["name"] == "kvconnectors-secret"


def changed(a: Any, b: Any, path: str = "") -> set[str]:
    """Paths (a.b[0].c) where `a` and `b` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {p for k in a.keys() | b.keys() for p in changed(a.get(k, KeyError), b.get(k, KeyError), f"{path}.{k}")}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {p for i, (x, y) in enumerate(zip(a, b)) for p in changed(x, y, f"{path}[{i}]")}
    return set() if a == b else {path}


def test_gpu_overlay_changes_only_image_gpus_and_engine_settings():
    cpu, gpu = manifests.render("cpu"), manifests.render("gpu")
    serve_cpu, serve_gpu = manifests.serve_config(cpu), manifests.serve_config(gpu)
    for m in (cpu, gpu):
        del m["spec"]["serveConfigV2"]
    allowed_k8s = (".image", ".rayStartParams.num-gpus", ".limits.nvidia.com/gpu", ".requests.nvidia.com/gpu")
    k8s = changed(cpu, gpu)
    assert k8s and all(p.endswith(allowed_k8s) for p in k8s), k8s
    assert all(c["image"] == "kvconnectors/ray-cuda:2.60.0" for c in manifests.containers(gpu))
    allowed_llm = {"engine_kwargs.dtype", "engine_kwargs.enforce_eager", "engine_kwargs.kv_cache_memory_bytes",
                   "engine_kwargs.block_size", "engine_kwargs.gpu_memory_utilization",
                   "engine_kwargs.kv_transfer_config.kv_connector_extra_config.dram_bytes",
                   "placement_group_config.bundles[0].GPU", "runtime_env"}
    llm = {p.split("_config.", 1)[1] for p in changed(serve_cpu, serve_gpu)}
    assert llm == allowed_llm, llm ^ allowed_llm
    for name in manifests.LLM_CONFIGS:
        cfg = serve_gpu["applications"][0]["args"][name]
        assert cfg["engine_kwargs"]["dtype"] == "bfloat16"
        assert cfg["placement_group_config"]["bundles"] == [{"CPU": 1, "GPU": 1}]
        LLMConfig.model_validate(cfg)  # still a config Ray takes


def test_gpu_overlay_refuses_unknown_keys():
    template = manifests.load(manifests.TEMPLATE)
    with pytest.raises(ValueError, match="gpus"):
        manifests.apply_gpu_overlay(template, {"image": "x", "gpus": 1})
    with pytest.raises(ValueError, match="gpus_per_replica=0"):
        manifests.apply_gpu_overlay(template, {"image": "x", "gpus_per_replica": 0})
