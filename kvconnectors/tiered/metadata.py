"""Scheduler -> worker metadata for one engine step (plain dataclasses keyed by request id).

It rides inside vLLM's SchedulerOutput to the worker processes, so it holds only plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                                KVConnectorMetadata)

from kvconnectors.errors import FailureCause


@dataclass
class SaveSpec:
    """Stage blocks [first_block, end_block) of a producer request after this step's layers run."""
    req_id: str
    transfer_id: str
    block_ids: list[int]      # local block ids for blocks [first_block, end_block)
    first_block: int
    total_blocks: int         # blocks of the whole prompt (the store entry's size)
    seal: bool                # this step completes the prompt: seal after the copies
    push_target: str = ""     # push mode: landing store "host:port" of rank 0 (rank r: port + r)
    layerwise: bool = True    # push: send each layer group as it is staged (else all after the last)
    token: str = ""           # the ticket's token: the store server grants it to the transfer at its first stage


@dataclass
class RecvSpec:
    """Pull a transfer into local blocks for a consumer request."""
    req_id: str
    params: dict | None       # the TransferParams as builtins (None when `error` is set)
    block_ids: list[int]      # local destination blocks, for remote blocks [first_block, ...)
    first_block: int
    error_cause: FailureCause | None = None  # params already found bad by the scheduler
    error_message: str = ""   # its TransferError.detail (the cause is error_cause)
    retries: int = 0          # extra attempts for transient failures (failure_policy "retry")


@dataclass
class TieredConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)   # transfer ids whose staging was abandoned
    idle_step: bool = False   # the step schedules no tokens: it only polls for finished loads


@dataclass
class TieredHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: where this rank's store server listens."""
    host: str
    port: int
    tp_rank: int
    fingerprint: str            # the model-wide KV fingerprint (KVLayout.fingerprint)
    shm_path: str = ""
    kv_heads: int = 0           # the model's KV heads (issue 20: goes in tickets with the rank count)
