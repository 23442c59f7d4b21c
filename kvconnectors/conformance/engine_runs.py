"""How a backend runs a real prefill -> decode pair (area "engine"; never run by the CPU-only
default suite: these build vLLM engines or servers).

- `one_engine_pd`: one in-process engine with kv_role kv_both (kvconnectors.testing.pd): the
  prefill leg returns params, the decode leg hands them back and loads over the connector's
  real transport from the same engine.
- `example_two_engine_pd`: producer engine, then consumer engine, one after the other in this
  process (ExampleConnector's store is a folder, so both need not be alive at once).
- `server_pd`: two live `vllm serve` processes (NixlConnector needs both alive), driven the way
  vLLM's toy proxy does: prefill with {"do_remote_decode": true} and max_tokens=1, then decode
  with the returned kv_transfer_params. The pair is kept for the next test of the class that
  asks for the same configuration (`KEPT_PAIR`), so a suite pays one start per configuration.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnectors.conformance.hooks import BackendHooks


@dataclass
class PDRun:
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    producer_params: list[dict | None] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)   # evidence a transfer happened, stats


_colocated_cache: dict[tuple, list[list[int]]] = {}


class KeptPair:
    """At most one live `vllm serve` pair, kept between the engine tests of one class that ask
    for the same configuration (backend, model, both kv-transfer configs). Asking for another
    configuration, building an in-process engine (`colocated`) or ending the class (the suite's
    class fixture) stops it first: never more than two engines at once."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.servers: list[Any] = []

    def get(self, key: tuple, start: Any) -> list[Any]:
        """The live pair for `key`; `start()` builds and starts a new one (the kept one stops first)."""
        if key != self.key or not all(s.is_running() for s in self.servers):
            self.close()
            self.servers = start()
            self.key = key
        return self.servers

    def close(self) -> None:
        servers, self.servers, self.key = self.servers, [], None
        for srv in reversed(servers):
            srv.stop()


KEPT_PAIR = KeptPair()


def colocated(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of a plain engine (no connector); cached per process."""
    key = (model, tuple(map(tuple, prompts)), max_tokens)
    if key not in _colocated_cache:
        from kvconnectors.testing.engines import generate_ids, llm_engine

        KEPT_PAIR.close()  # no in-process engine beside a kept server pair
        with llm_engine(model) as llm:
            _colocated_cache[key] = generate_ids(llm, prompts, max_tokens)
    return _colocated_cache[key]


def _fault(backend: "BackendHooks", fault: str | None) -> tuple[dict[str, Any], Any]:
    """(extra config, consumer-params rewrite) for `fault`; skips when the backend has no hook."""
    import pytest

    def same(p: Any) -> Any:
        return p

    if fault is None:
        return {}, same
    if fault == "corrupt":
        extra = backend.corrupt_extra()
        if extra is None:
            pytest.skip(f"{backend.name}: no corruption hook (corrupt_extra() returns None)")
        return extra, same
    extra = backend.fault_extra()
    if extra is not None:
        return extra, same
    if backend.fault_params({"probe": True}) is not None:
        return {}, backend.fault_params
    pytest.skip(f"{backend.name}: no load-failure hook (fault_extra() and fault_params() return None)")


def one_engine_pd(backend: "BackendHooks", model: str, prompts: list[list[int]], max_tokens: int, *,
                  fault: str | None = None, policy: str = "fail") -> PDRun:
    from kvconnectors.testing.engines import generate_outputs, llm_engine
    from kvconnectors.testing.pd import assert_engine_idle, worker_connector

    extra, params_fn = _fault(backend, fault)
    cfg = backend.kv_transfer_config(backend.engine_role, policy=policy, extra=extra)
    with llm_engine(model, kv_transfer_config=cfg) as llm:
        sent = [backend.producer_params() for _ in prompts]
        tickets = [o.kv_transfer_params for o in generate_outputs(llm, prompts, 1, sent)]
        consumer = [params_fn(backend.consumer_params(t, sent=s)) for t, s in zip(tickets, sent)]
        outs = generate_outputs(llm, prompts, max_tokens, consumer)
        notes: dict[str, Any] = {}
        totals = getattr(getattr(worker_connector(), "connector_worker", None), "totals", None)
        if totals is not None:
            notes["worker_totals"] = dict(totals.data)
        assert_engine_idle(llm)
    return PDRun(token_ids=[list(o.outputs[0].token_ids) for o in outs],
                 finish_reasons=[o.outputs[0].finish_reason for o in outs], producer_params=tickets,
                 notes=notes)


def example_two_engine_pd(backend: "BackendHooks", model: str, prompts: list[list[int]], max_tokens: int, *,
                          fault: str | None = None, policy: str = "fail", workdir: Path) -> PDRun:
    """Producer engine writes the store, consumer engine reads it. fault="corrupt" replaces the
    stored KV by noise between the two (the store has no integrity check to catch it)."""
    import pytest

    from kvconnectors.testing.engines import generate_ids, generate_outputs, llm_engine

    if fault == "fail":
        pytest.skip(f"{backend.name}: no load-failure hook (loads read files synchronously and never report)")
    store = Path(workdir) / "example_pd_store"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)

    def cfg(role: str) -> dict[str, Any]:
        c = backend.kv_transfer_config(role, policy=policy)
        c["kv_connector_extra_config"]["shared_storage_path"] = str(store)
        return c

    with llm_engine(model, kv_transfer_config=cfg("kv_producer")) as llm:
        generate_ids(llm, prompts, 1)
    files = sorted(store.rglob("*.safetensors"))
    if fault == "corrupt":
        import torch
        from safetensors.torch import load_file, save_file

        gen = torch.Generator().manual_seed(0)
        for f in files:
            kv = load_file(str(f))["kv_cache"]
            save_file({"kv_cache": torch.randn(kv.shape, generator=gen, dtype=kv.dtype) * 3}, str(f))
    with llm_engine(model, kv_transfer_config=cfg("kv_consumer")) as llm:
        outs = generate_outputs(llm, prompts, max_tokens)
    return PDRun(token_ids=[list(o.outputs[0].token_ids) for o in outs],
                 finish_reasons=[o.outputs[0].finish_reason for o in outs],
                 notes={"stored_files": len(files)})


def server_pd(backend: "BackendHooks", model: str, prompts: list[list[int]], max_tokens: int, *,
              fault: str | None = None, policy: str = "fail", workdir: Path) -> PDRun:
    """Two live `vllm serve` processes (one per core) and the proxy flow, for connectors whose
    consumer must reach a live producer (`capabilities.needs_two_engines`)."""
    import json
    import urllib.error

    from kvconnectors.serving import VllmServer, complete

    extra, params_fn = _fault(backend, fault)
    roles = (backend.producer_role, backend.consumer_role)
    configs = [backend.kv_transfer_config(role, policy=policy, extra=extra) for role in roles]

    def start() -> list[VllmServer]:
        servers: list[VllmServer] = []
        try:
            for i, (role, cfg) in enumerate(zip(roles, configs)):
                servers.append(VllmServer(model, name=f"{backend.name}-{role}", core=i % 2,
                                          extra_args=["--kv-transfer-config", json.dumps(cfg)],
                                          env=backend.environment(role, f"server-{i}"),
                                          log_path=Path(workdir) / f"{role}.log"))
            for srv in servers:
                srv.start(wait=False)
            for srv in servers:
                srv.wait_healthy()
        except BaseException:
            for srv in reversed(servers):
                srv.stop()
            raise
        return servers

    key = (type(backend).__qualname__, model, *(json.dumps(c, sort_keys=True) for c in configs))
    servers = KEPT_PAIR.get(key, start)
    try:
        prefill_srv, decode_srv = servers
        name = prefill_srv.served_model_name
        token_ids, reasons, params = [], [], []
        for p in prompts:
            sent = backend.producer_params()
            first = complete(prefill_srv.url, p, model=name, max_tokens=1, kv_transfer_params=sent, timeout=120)
            ktp = first.get("kv_transfer_params")
            params.append(ktp)
            try:
                resp = complete(decode_srv.url, p, model=name, max_tokens=max_tokens,
                                kv_transfer_params=params_fn(backend.consumer_params(ktp, sent=sent)),
                                timeout=120)
            except urllib.error.HTTPError as exc:
                if exc.code != 500:
                    raise
                token_ids.append([])  # vLLM turns finish_reason "error" into HTTP 500
                reasons.append("error")
                continue
            choice = resp["choices"][0]
            token_ids.append(list(choice.get("token_ids") or []))
            reasons.append(choice.get("finish_reason"))
        return PDRun(token_ids=token_ids, finish_reasons=reasons, producer_params=params,
                     notes={"logs": [str(s.log_path) for s in servers]})
    except BaseException:
        KEPT_PAIR.close()  # a pair that failed a test is not handed to the next one
        raise
