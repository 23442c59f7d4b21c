"""Real TieredConnectorWorkers on CPU KV caches, built as vLLM builds them, without an engine.

The benchmarks time the worker's own code through these: a producer stages a prompt with
save_kv_layer / wait_for_save (its StagingBook, Stager and store, served by its StoreServer), a
consumer loads a ticket with start_load_kv / take_results (its Puller, PullPaths and PeerLinks).
vLLM is not started: its config holds only the fields the worker reads (testing/worker_config.py).
The caches are vLLM's CPU layout (LBHNC: one [blocks, kv_heads, block_tokens, 2 x head_dim] tensor
per layer) over the caller's byte arrays, so a benchmark can fill and check them as plain [blocks,
slot] bytes.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
import numpy as np
import torch

from kvconnectors import planner
from kvconnectors.testing.worker_config import worker_vllm_config
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.metadata import RecvSpec, SaveSpec, TieredConnectorMetadata
from kvconnectors.tiered.worker import TieredConnectorWorker

DTYPES = {4: torch.float32, 2: torch.bfloat16}


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def cpu_caches(arrays: list[np.ndarray], model: planner.ModelSpec, block_tokens: int) -> dict[str, torch.Tensor]:
    """One LBHNC cache per layer over each [blocks, slot] uint8 array, sharing its memory."""
    if model.dtype_bytes not in DTYPES:
        raise ValueError(f"no {model.dtype_bytes}-byte KV dtype on CPU here (fp32 and bf16 only)")
    shape = (model.kv_heads, block_tokens, 2 * model.head_dim)
    return {layer_name(i): torch.from_numpy(a).view(DTYPES[model.dtype_bytes]).view(a.shape[0], *shape)
            for i, a in enumerate(arrays)}


def make_worker(role: str, caches: dict[str, torch.Tensor], model: planner.ModelSpec, block_tokens: int,
                engine_id: str, **config: Any) -> TieredConnectorWorker:
    """A TP-1 worker ("p": producer, "c": consumer) over `caches`, its parts assembled by
    register_kv_caches; `config`: TieredConfig fields."""
    vllm_config = worker_vllm_config(role, block_tokens, model.kv_heads, model_name=model.name)
    worker = TieredConnectorWorker(vllm_config, TieredConfig(**config), engine_id)
    try:
        worker.register_kv_caches(caches)
    except BaseException:
        worker.shutdown()
        raise
    return worker


def stage(worker: TieredConnectorWorker, tid: str, block_ids: list[int], block_tokens: int,
          push_target: str = "", layerwise: bool = True) -> dict[str, Any]:
    """The producer's step for a whole prompt in `block_ids`: every layer handed to the staging
    thread, then wait_for_save (every byte in the store, the entry sealed). Returns the ticket the
    scheduler would hand the consumer (TransferParams as builtins)."""
    token = secrets.token_hex(16)
    n = len(block_ids)
    meta = TieredConnectorMetadata(saves=[SaveSpec("bench", tid, block_ids, 0, n, True, push_target=push_target,
                                                   layerwise=layerwise, token=token)])
    assert worker.layout is not None, "register_kv_caches first"
    for layer in range(worker.layout.num_layers):
        worker.save_kv_layer(meta, layer_name(layer))
    worker.wait_for_save(meta)
    hs = worker.get_handshake_metadata()
    assert hs is not None
    return msgspec.to_builtins(kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id=tid, addrs=[kvparams.PeerAddress(hs.host, hs.port)],
        num_tokens=n * block_tokens, num_blocks=n, block_size=block_tokens, fingerprint=hs.fingerprint,
        prompt_hash="bench", lease_ttl_s=worker.config.lease_ttl_s, issued_at=int(time.time()), token=token,
        tp_size=1, kv_heads=hs.kv_heads, shm_path=hs.shm_path, push_target=push_target))


def load(worker: TieredConnectorWorker, req_id: str, ticket: dict[str, Any], block_ids: list[int],
         timeout_s: float) -> None:
    """One request's load into `block_ids`, as vLLM drives it: start_load_kv, then take_results
    until the request is reported done (returns) or failed (raises its TransferError)."""
    worker.start_load_kv(TieredConnectorMetadata(recvs=[RecvSpec(req_id, ticket, block_ids, 0)]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = worker.take_results(wait_s=0.5)
        if req_id in failed:
            raise failed[req_id]
        if req_id in done:
            return
    raise TimeoutError(f"the load of {req_id} was not reported within {timeout_s:.0f} s")
