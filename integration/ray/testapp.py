"""The Ray Serve LLM P/D app of the tests: integration/ray/serve_pd_cpu.yaml with only what a test must
set (the model's path, where Serve listens, replica counts, push mode, placement, test hooks), and
the client calls and log reads the Ray tests share (tests/e2e/test_ray_*.py). Here, beside the Serve
config it edits: kvconnectors/ never imports the integration folder."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvconnectors.integration.ray import manifests
from kvconnectors.serving import complete, post_json
from kvconnectors.testing.raycluster import RayCluster
from kvconnectors.transport.client import store_status
from kvconnectors.transport.wire import StatusReply

MODEL = "tiny"  # model_id in the Serve config
CHAT = [{"role": "user", "content": "Tell me about the river and the tier."}]


def app_config(model: str, *, http_host: str, http_port: int, prefill_store_port: int, lease_ttl_s: float,
               decode_replicas: int = 1, push: bool = False, decode_store_port: int | None = None,
               prefill_resources: Mapping[str, float] | None = None,
               decode_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The committed Serve config with the test's values; everything else as users get it.
    `*_resources`: custom Ray resources added to that deployment's bundle (node placement).
    The decode lets the client's `kvc_fault` through (test hooks on both sides)."""
    cfg = copy.deepcopy(manifests.load(manifests.SERVE_CONFIG))
    cfg["http_options"] = {"host": http_host, "port": http_port}
    args = cfg["applications"][0]["args"]
    for key, resources in zip(manifests.LLM_CONFIGS, (prefill_resources, decode_resources)):
        llm = args[key]
        llm["model_loading_config"]["model_source"] = model
        extra = llm["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
        extra.update(test_hooks=True, lease_ttl_s=lease_ttl_s)
        if resources:
            llm["placement_group_config"]["bundles"][0].update(resources)
    extra_of = lambda key: args[key]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]  # noqa: E731
    extra_of("prefill_config")["store_port"] = prefill_store_port
    decode = args["decode_config"]
    decode["deployment_config"]["num_replicas"] = decode_replicas
    decode["experimental_configs"] = {"kvconnectors_forward_kv_params": ["kvc_fault"], "kvconnectors_unlock_transfer_keys": True}
    if push:
        extra_of("decode_config").update(transfer_mode="push", store_port=decode_store_port)
    return cfg


def colocated_outputs(model: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy token ids of `prompts` and the answer to CHAT from one plain engine with the Serve
    config's engine settings: the references of the Ray tests (computed before a cluster takes the cores)."""
    from kvconnectors.testing.engines import generate_ids, greedy, llm_engine  # noqa: PLC0415 - imports vLLM

    with llm_engine(model, max_model_len=2048) as llm:
        ids = generate_ids(llm, prompts, max_tokens)
        text = llm.chat(CHAT, greedy(max_tokens), use_tqdm=False)[0].outputs[0].text
    return {"ids": ids, "chat": text}


def token_ids(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    return list(complete(url, prompt, model=MODEL, max_tokens=max_tokens, timeout=120, **extra)["choices"][0]
                ["token_ids"])


def chat(url: str, max_tokens: int, stream: bool) -> str:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        return post_json(f"{url}/v1/chat/completions", body, timeout=120)["choices"][0]["message"]["content"]

    async def go() -> str:
        text = ""
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"chat stream: HTTP {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    text += json.loads(line[5:])["choices"][0].get("delta", {}).get("content") or ""
        return text
    return asyncio.run(go())


def store_when_empty(host: str, port: int, secret: str, timeout: float = 15.0) -> StatusReply:
    """The store's status once it holds nothing (or at `timeout`, for the caller to assert on)."""
    deadline = time.monotonic() + timeout
    while True:
        status = store_status(host, port, secret=secret.encode())
        if (status.entries == 0 and status.dram_used_bytes == 0) or time.monotonic() > deadline:
            return status
        time.sleep(0.25)


def assert_backend_found(cluster: RayCluster) -> None:
    """Ray looked our backend up and found it: no replica fell back to its default backend, and our
    backend's setup() ran in the prefill and the decode replicas."""
    logs = {**cluster.serve_logs(), **cluster.worker_logs()}
    bad = [name for name, text in logs.items() if "Unsupported connector backend" in text]
    assert not bad, f"Ray logged 'Unsupported connector backend' in {bad}"
    for role in ("kv_producer", "kv_consumer"):
        assert any(f"TieredConnector on Ray: {role}" in t for t in logs.values()), f"our backend's setup() never ran for {role}"
