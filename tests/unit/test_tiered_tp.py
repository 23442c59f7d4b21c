"""Prefill and decode pools of different TP sizes through the real worker code (issue 20), no engine.

Producer ranks and consumer ranks are TieredConnectorWorkers in this process, each with its own
CPU KV cache (vLLM's CPU shape [blocks, heads, tokens, 2 * head_size]), store and tcp store server.
The tiny model's 2 KV heads: one TP=1 reference cache holds both; a TP=2 rank holds head r of it.
Producers stage through save_kv_layer / wait_for_save; consumers load through start_load_kv /
take_results; every consumer rank's loaded blocks are compared byte for byte with the reference's
heads of that rank. Negative controls: a corrupted producer rank (server fault plan), a killed
producer rank, a different model-wide layout, an unsliceable layout.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.heads import head_map
from kvconnectors.mover.shapes import synthetic_caches
from kvconnectors.testing.worker_config import worker_vllm_config
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.layout import detect_layout
from kvconnectors.tiered.metadata import RecvSpec, SaveSpec, TieredConnectorMetadata
from kvconnectors.tiered.tp import plan_for

HEADS, LAYERS, BLOCKS, BS, C = 2, 3, 8, 16, 8  # tiny-model-like: 2 KV heads, head size 4 (fp32: C = 2 * 4)
PRODUCER_IDS, CONSUMER_IDS = [5, 1, 6], [2, 7, 0]  # a 3-block prompt in different blocks on each side


def reference() -> dict[str, torch.Tensor]:
    return synthetic_caches("LBHNC", num_layers=LAYERS, num_blocks=BLOCKS, heads=HEADS, block_size=BS, content=C,
                            dtype=torch.float32, seed=7)


def rank_caches(full: dict[str, torch.Tensor] | None, tp: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s cache at TP `tp`: the reference's heads of that rank (vLLM's split), or noise."""
    hr = head_map(HEADS, tp)[rank]
    caches = synthetic_caches("LBHNC", num_layers=LAYERS, num_blocks=BLOCKS, heads=hr.count, block_size=BS,
                              content=C, dtype=torch.float32, seed=seed)
    if full is not None:
        for name, t in caches.items():
            t.copy_(full[name][:, hr.start:hr.stop])
    return caches


def make_worker(role: str, tp: int, rank: int, caches: dict[str, torch.Tensor], monkeypatch, **cfg):
    import vllm.distributed.parallel_state as ps

    from kvconnectors.tiered.worker import TieredConnectorWorker

    vllm_config = worker_vllm_config(role, BS, HEADS, tp_size=tp)
    w = TieredConnectorWorker(vllm_config, TieredConfig(dram_bytes="4m", load_timeout_s=10, connect_timeout_s=2,
                                                        **cfg), f"{role}{tp}-{rank}")
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    w.register_kv_caches(caches)
    return w


def stage(producers, tid: str, token: str, ids: list[int] = PRODUCER_IDS, push_target: str = "") -> dict:
    """Every producer rank stages the prompt in blocks `ids` (and pushes it to `push_target`, when
    given, waiting until the pushes went out); returns the ticket the scheduler would hand out."""
    meta = TieredConnectorMetadata(saves=[SaveSpec("r", tid, ids, 0, len(ids), True, token=token,
                                                   push_target=push_target)])
    for w in producers:
        for name in w._layer_index:
            w.save_kv_layer(meta, name)
        w.wait_for_save(meta)
    for w in producers:
        assert w.staging.pushes.sender.flush(10)
    metas = [w.get_handshake_metadata() for w in producers]
    ticket = kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id=tid, addrs=[kvparams.PeerAddress(m.host, m.port) for m in metas],
        num_tokens=len(ids) * BS, num_blocks=len(ids), block_size=BS,
        fingerprint=metas[0].fingerprint, prompt_hash="h", lease_ttl_s=30, issued_at=0, token=token,
        tp_size=len(producers), kv_heads=metas[0].kv_heads, shm_path=metas[0].shm_path, push_target=push_target)
    return msgspec.to_builtins(ticket)


def load(consumers, ticket: dict, ids: list[int] = CONSUMER_IDS) -> dict[int, TransferError | None]:
    """Every consumer rank loads the ticket into blocks `ids`; its outcome per rank."""
    for w in consumers:
        w.start_load_kv(TieredConnectorMetadata(recvs=[RecvSpec("r", ticket, ids, 0)]))
    out: dict[int, TransferError | None] = {}
    deadline = time.monotonic() + 20
    while len(out) < len(consumers) and time.monotonic() < deadline:
        for i, w in enumerate(consumers):
            done, failed = w.take_results()
            if "r" in done and "r" not in failed and w.inflight_loads == 0 and i not in out:
                out[i] = None
            if "r" in failed:
                out[i] = failed["r"]
        time.sleep(0.01)
    assert len(out) == len(consumers), out
    return out


def loaded_equals_reference(full, consumer, tp: int, rank: int, ids: tuple[list[int], list[int]] = (
        PRODUCER_IDS, CONSUMER_IDS)) -> bool:
    hr = head_map(HEADS, tp)[rank]
    theirs, mine = ids
    return all(torch.equal(consumer.geometry.views[i][mine].contiguous().view(torch.uint8),
                           full[name][theirs][:, hr.start:hr.stop].contiguous().view(torch.uint8))
               for i, name in enumerate(full))


@pytest.fixture
def pools(monkeypatch):
    """pools(P, D, producer_cfg=..., consumer_cfg=...) -> (reference, producer ranks, consumer ranks)."""
    made = []

    def build(p_tp: int, d_tp: int, producer_cfg: dict | None = None, consumer_cfg: dict | None = None):
        full = reference()
        producers = [make_worker("p", p_tp, r, rank_caches(full, p_tp, r, 0), monkeypatch, **(producer_cfg or {}))
                     for r in range(p_tp)]
        consumers = [make_worker("c", d_tp, r, rank_caches(None, d_tp, r, 100 + r), monkeypatch, **(consumer_cfg or {}))
                     for r in range(d_tp)]
        made.extend(producers + consumers)
        return full, producers, consumers
    yield build
    for w in made:
        w.shutdown()


# ------------------------------------------------------------------------------- fingerprints, plans
def layout(tp: int, rank: int, *, content: int = C, backend: str = "FLASH_ATTN", physical: str = "LBHNC"):
    caches = synthetic_caches(physical, num_layers=LAYERS, num_blocks=BLOCKS, heads=head_map(HEADS, tp)[rank].count,
                              block_size=BS, content=content, dtype=torch.float32, device="meta")
    return detect_layout(caches, BS, physical, tp_size=tp, tp_rank=rank, model="tiny", backend=backend,
                         total_kv_heads=HEADS)[0]


def ticket_for(lay, tp: int, v: int = kvparams.PARAMS_VERSION) -> kvparams.TransferParams:
    return kvparams.TransferParams(v=v, transfer_id="t", addrs=[kvparams.PeerAddress("127.0.0.1", 1 + r) for r in range(tp)],
                                   num_tokens=16, num_blocks=1, block_size=BS,
                                   fingerprint=lay.fingerprint if v >= 4 else lay.rows_fingerprint, prompt_hash="h",
                                   lease_ttl_s=30, issued_at=0, **({"tp_size": tp, "kv_heads": lay.kv_heads}
                                                                   if v >= 4 else {}))


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC"])
def test_the_fingerprint_describes_the_whole_model_not_one_rank(physical) -> None:
    one, two = layout(1, 0, physical=physical), [layout(2, r, physical=physical) for r in range(2)]
    assert one.fingerprint == two[0].fingerprint == two[1].fingerprint
    assert one.kv_heads == two[0].kv_heads == HEADS
    assert one.rows_fingerprint != two[0].rows_fingerprint == two[1].rows_fingerprint  # rows differ with TP
    assert layout(1, 0, content=2 * C, physical=physical).fingerprint != one.fingerprint  # head size


def test_equal_tp_loads_rank_to_rank_as_before_and_previous_tickets_still_do() -> None:
    for tp in (1, 2):
        lay = layout(tp, tp - 1)
        assert plan_for(ticket_for(lay, tp), lay, UnsupportedKVCache("not needed")) is None
        assert plan_for(ticket_for(lay, tp, v=3), lay, UnsupportedKVCache("not needed")) is None


def test_a_previous_ticket_from_another_tp_size_is_refused_naming_both_sides() -> None:
    with pytest.raises(TransferError) as exc:
        plan_for(ticket_for(layout(2, 0), 2, v=3), layout(1, 0), UnsupportedKVCache("x"))
    assert exc.value.cause is FailureCause.LAYOUT_MISMATCH
    assert "producer KV layout" in exc.value.detail and "TP 2" in exc.value.detail and "TP 1, 2 KV heads" in exc.value.detail


def test_another_model_is_refused_naming_both_tp_sizes_and_kv_head_counts() -> None:
    consumer = layout(1, 0)
    producer = layout(2, 0, content=2 * C)
    with pytest.raises(TransferError) as exc:
        plan_for(ticket_for(producer, 2), consumer, UnsupportedKVCache("x"))
    d = exc.value.detail
    assert exc.value.cause is FailureCause.LAYOUT_MISMATCH and "differs from this consumer's" in d
    assert "producer KV layout" in d and "(TP 2, 2 KV heads)" in d and "TP 1, 2 KV heads" in d, d


def test_an_unsliceable_layout_is_refused_naming_tp_heads_layout_and_dtype() -> None:
    from kvconnectors.mover.reslice import row_layout

    consumer = layout(1, 0)
    try:
        row_layout("LBNHC", heads=2, tokens=BS, content_bytes=32, dtype="bfloat16", backend="CPU_ATTN")
    except UnsupportedKVCache as exc:
        refusal = exc
    with pytest.raises(TransferError) as exc:
        plan_for(ticket_for(layout(2, 0), 2), consumer, refusal)
    d = exc.value.detail
    assert "TP 2, 2 KV heads" in d and "TP 1, 2 KV heads" in d and "LBNHC" in d and "bfloat16" in d, d


@pytest.mark.parametrize("backend, physical, refused", [("CPU_ATTN", "LBNHC", True), ("CPU_ATTN", "LBHNC", False),
                                                         ("FLASH_ATTN", "LBNHC", False)])
def test_a_cache_that_cannot_be_sliced_is_said_at_start_up_naming_layout_and_dtype(monkeypatch, caplog, backend,
                                                                                    physical, refused) -> None:
    """register_kv_caches says, once, that pools of another TP size will be refused, naming the
    layout, dtype and backend, for a cache whose heads have no byte ranges (vLLM CPU attention's
    packing with tokens outermost); a sliceable cache says nothing."""
    import logging

    import kvconnectors.tiered.worker as worker

    monkeypatch.setattr(worker, "_attention_backend", lambda vllm_config: backend)
    caches = synthetic_caches(physical, num_layers=LAYERS, num_blocks=BLOCKS, heads=HEADS, block_size=BS, content=C,
                              dtype=torch.bfloat16, seed=3)
    vllm_config = worker_vllm_config("c", BS, HEADS, layout=physical)
    w = worker.TieredConnectorWorker(vllm_config, TieredConfig(dram_bytes="4m"), "c-startup")
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnectors"):
            w.register_kv_caches(caches)
        said = [r.getMessage() for r in caplog.records if "another tensor-parallel size" in r.getMessage()]
        if refused:
            assert len(said) == 1 and all(p in said[0] for p in (physical, "bfloat16", backend)), said
            assert isinstance(w._row_layout, UnsupportedKVCache)
        else:
            assert not said
    finally:
        w.shutdown()


# ------------------------------------------------------------------------------- worker, end to end
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("ids", [(PRODUCER_IDS, CONSUMER_IDS), ([4], [3])], ids=["3-blocks", "1-block"])
def test_consumer_ranks_assemble_byte_exact_blocks_from_another_tp_size(pools, p_tp, d_tp, ids) -> None:
    full, producers, consumers = pools(p_tp, d_tp)
    ticket = stage(producers, "t-ok", kvparams.new_token(), ids[0])
    assert all(v is None for v in load(consumers, ticket, ids[1]).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, d_tp, r, ids), f"consumer rank {r}"
    row = consumers[0].geometry.block_bytes
    read = sum(w.totals.data["bytes_by_path"].get("tcp", 0) for w in consumers)
    needed = d_tp * LAYERS * len(ids[1]) * row
    # both ways exactly the heads each consumer rank keeps travel (P < D: packed by the producer)
    assert read == needed == sum(w.server.counters.bytes_sent for w in producers), (read, needed)


def test_a_producer_that_sends_no_head_slices_is_read_whole_and_the_result_is_the_same(pools) -> None:
    """A producer of the previous version offers no inline_heads path: it refuses the sliced read
    in step and the consumer rank reads its whole rows instead (D / P times the bytes)."""
    full, producers, consumers = pools(1, 2)
    del producers[0].server.paths["inline_heads"]
    ticket = stage(producers, "t-old", kvparams.new_token())
    assert all(v is None for v in load(consumers, ticket).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, 2, r), f"consumer rank {r}"
    read = sum(w.totals.data["bytes_by_path"]["tcp"] for w in consumers)
    assert read == 2 * 2 * LAYERS * len(CONSUMER_IDS) * consumers[0].geometry.block_bytes


@pytest.mark.parametrize("where", ["wire", "store"])
def test_a_corrupted_head_slice_fails_the_load_as_a_checksum_mismatch(pools, where) -> None:
    """P1 -> D2, sliced reads: bytes flipped on the wire fail the consumer's check of the packed
    rows; bytes flipped in the producer's store fail the producer's check against the staged
    checksums before anything is sent (a packed row's fresh checksum would not catch them)."""
    cfg = {"fault_injection": [{"action": "corrupt", "on": "read"}]} if where == "wire" else None
    full, producers, consumers = pools(1, 2, producer_cfg=cfg)
    ticket = stage(producers, "t-flip", kvparams.new_token())
    if where == "store":
        producers[0].store.arena_slots()[:, 0] ^= 0xFF  # every slot's first byte: the entry's rows too
    errors = load(consumers, ticket)
    assert all(e is not None and e.cause is FailureCause.CHECKSUM_MISMATCH and "producer rank 0 of 1" in e.detail
               for e in errors.values()), errors
    assert not any(loaded_equals_reference(full, w, 2, r) for r, w in enumerate(consumers))


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_sliced_pulls_over_shm_read_every_rank_and_leave_the_release_to_the_lease_keeper(pools, p_tp, d_tp) -> None:
    """transport shm: each consumer rank copies its producer ranks' rows out of their arenas and
    answers "read, keep it" (a producer rank may serve several consumer ranks: P1 -> D2), so every
    producer entry is still there for the scheduler's lease keeper to release."""
    shm = {"transport": "shm"}
    full, producers, consumers = pools(p_tp, d_tp, producer_cfg=shm, consumer_cfg=shm)
    ticket = stage(producers, "t-shm", kvparams.new_token())
    assert all(v is None for v in load(consumers, ticket).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, d_tp, r), f"consumer rank {r}"
        by_path = w.totals.data["bytes_by_path"]
        assert by_path.get("shm", 0) > 0 and not by_path.get("tcp"), by_path
    assert all(w.store.usage()["entries"] == 1 for w in producers), [w.store.usage() for w in producers]
    assert sum(w.server.counters.bytes_sent for w in producers) == sum(
        w.totals.data["bytes_by_path"]["shm"] for w in consumers), "a producer did not count a kept read"


def test_a_corrupted_producer_rank_fails_the_load_naming_it_and_lands_nothing(pools) -> None:
    full, producers, consumers = pools(2, 1, producer_cfg={"fault_injection": [{"action": "corrupt", "on": "read"}]})
    producers[0].server.faults = producers[0].config.fault_plan.__class__.from_config(None)  # only rank 1 corrupts
    before = [consumers[0].geometry.views[i][CONSUMER_IDS].clone() for i in range(LAYERS)]
    ticket = stage(producers, "t-bad", kvparams.new_token())
    err = load(consumers, ticket)[0]
    assert err is not None and err.cause is FailureCause.CHECKSUM_MISMATCH and "producer rank 1 of 2" in err.detail, err
    assert all(torch.equal(b, consumers[0].geometry.views[i][CONSUMER_IDS]) for i, b in enumerate(before))


def test_a_killed_producer_rank_fails_the_load_typed_naming_it(pools) -> None:
    full, producers, consumers = pools(2, 1)
    ticket = stage(producers, "t-dead", kvparams.new_token())
    producers[1].server.close()
    producers[1].server = None
    err = load(consumers, ticket)[0]
    assert err is not None and err.cause is FailureCause.PEER_UNREACHABLE and "producer rank 1 of 2" in err.detail, err
    assert not loaded_equals_reference(full, consumers[0], 1, 0)


def test_producer_ranks_are_read_side_by_side_and_the_first_to_fail_fails_the_load(pools) -> None:
    """Rank 0 never answers, rank 1 is gone: read one after the other, the load would wait out its
    deadline on rank 0 and blame it; read side by side, rank 1's failure ends it at once, named."""
    full, producers, consumers = pools(2, 1, producer_cfg={"fault_injection": [{"action": "drop"}]})
    producers[1].server.faults = producers[1].config.fault_plan.__class__.from_config(None)
    ticket = stage(producers, "t-side", kvparams.new_token())
    producers[1].server.close()
    producers[1].server = None
    start = time.monotonic()
    err = load(consumers, ticket)[0]
    assert err is not None and err.cause is FailureCause.PEER_UNREACHABLE and "producer rank 1 of 2" in err.detail, err
    assert time.monotonic() - start < 5.0  # load_timeout_s is 10: rank 0's read was not waited out


class Keeper:
    """The lease keeper stand-in: records what the scheduler asks of it."""

    def __init__(self):
        self.calls = []

    def track(self, req_id, addrs, tid, **kw):
        self.calls.append(("track", req_id, list(addrs)))
        self.maybe_ids = list(kw.get("maybe_ids", ()))

    def untrack(self, req_id):
        self.calls.append(("untrack", req_id))

    def release(self, req_id, addrs, tid, token=""):
        self.calls.append(("release", req_id, list(addrs)))

    def close(self):
        pass


def consumer_scheduler(d_tp: int):
    """A consumer scheduler at TP `d_tp` with a recording keeper, and a ticket from a TP=2 producer."""
    from kvconnectors.tiered.scheduler import TieredConnectorScheduler

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=d_tp),
                                  kv_transfer_config=SimpleNamespace(is_kv_consumer=False))
    sched = TieredConnectorScheduler(vllm_config, TieredConfig(), "e")
    sched._keeper = Keeper()
    ticket = msgspec.to_builtins(ticket_for(layout(2, 0), 2))
    ticket["token"] = kvparams.new_token()
    return sched, ticket


def test_the_scheduler_releases_every_producer_rank_after_a_resliced_load() -> None:
    for d_tp, last in ((1, ("release", "r", [("127.0.0.1", 1), ("127.0.0.1", 2)])), (2, ("untrack", "r"))):
        sched, ticket = consumer_scheduler(d_tp)
        keeper = sched._keeper
        sched.on_new_request(SimpleNamespace(request_id="r", kv_transfer_params={"kvc": ticket, "do_remote_prefill": True}))
        sched.update_connector_output(SimpleNamespace(finished_recving={"r"}))
        assert keeper.calls[0] == ("track", "r", [("127.0.0.1", 1), ("127.0.0.1", 2)])
        assert keeper.calls[-1] == last, (d_tp, keeper.calls)


def test_a_pushed_request_from_a_larger_tp_size_has_its_head_fragments_renewed() -> None:
    from kvconnectors.tiered.tp import fragment_id

    for d_tp, fragments in ((1, [0, 1]), (2, [])):
        sched, ticket = consumer_scheduler(d_tp)
        sched.config = TieredConfig(transfer_mode="push")
        ticket["push_target"] = "127.0.0.1:9"
        sched.on_new_request(SimpleNamespace(request_id="r",
                                             kv_transfer_params={"kvc": ticket, "do_remote_prefill": True}))
        assert sched._keeper.maybe_ids == [fragment_id(ticket["transfer_id"], r) for r in fragments], d_tp


def test_a_resliced_load_aborted_under_way_still_releases_every_producer_rank() -> None:
    """Aborted while its load runs: no worker releases a resliced transfer, so the scheduler must
    release every producer rank once the worker reports the load over (not leave them to expiry)."""
    from vllm.v1.request import RequestStatus

    sched, ticket = consumer_scheduler(1)
    prompt = list(range(ticket["num_tokens"]))
    request = SimpleNamespace(request_id="r", kv_transfer_params={"kvc": ticket, "do_remote_prefill": True},
                              prompt_token_ids=prompt, status=RequestStatus.FINISHED_ABORTED)
    sched.on_new_request(request)
    blocks = SimpleNamespace(get_block_ids=lambda: [list(range(ticket["num_blocks"]))])
    sched.update_state_after_alloc(request, blocks, len(prompt))  # the load is handed to the worker
    assert sched.request_finished(request, []) == (False, None)   # aborted meanwhile
    sched.update_connector_output(SimpleNamespace(finished_recving={"r"}))
    assert sched._keeper.calls[-1] == ("release", "r", [("127.0.0.1", 1), ("127.0.0.1", 2)]), sched._keeper.calls


# ------------------------------------------------------------------------------- idle engine steps
def test_an_idle_step_waits_for_a_load_in_flight_and_returns_as_soon_as_it_lands(pools) -> None:
    """A step that schedules nothing while a load is in flight waits for it (the engine would
    otherwise spin its ranks on empty steps), but only until the load is in, not the whole wait."""
    full, producers, consumers = pools(1, 1, producer_cfg={"fault_injection": [{"action": "delay", "delay_s": 0.5}]})
    ticket = stage(producers, "t-idle", kvparams.new_token())
    w = consumers[0]
    assert w.take_results(wait_s=5.0) == (set(), {})  # nothing in flight: no wait
    w.start_load_kv(TieredConnectorMetadata(recvs=[RecvSpec("r", ticket, CONSUMER_IDS, 0)]))
    assert w.take_results() == (set(), {})             # a busy step never waits (the read is held 0.5 s)
    start = time.monotonic()
    done, failed = w.take_results(wait_s=8.0)
    assert done == {"r"} and not failed and time.monotonic() - start < 6.0, (done, failed)
    assert loaded_equals_reference(full, w, 1, 0)


def test_only_steps_that_schedule_no_tokens_wait_and_for_idle_wait_s() -> None:
    from kvconnectors.tiered.connector import TieredConnector

    sched, _ = consumer_scheduler(1)
    assert sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).idle_step
    assert not sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=3)).idle_step
    waits = []
    connector = object.__new__(TieredConnector)
    connector.connector_worker = SimpleNamespace(config=TieredConfig(idle_wait_s=0.05),
                                                 take_results=lambda wait_s: waits.append(wait_s) or (set(), {}))
    for idle in (True, False):
        connector._connector_metadata = TieredConnectorMetadata(idle_step=idle)
        connector.get_transfer_results(set())
    connector._connector_metadata = None  # no metadata bound: never wait
    connector.get_transfer_results(set())
    assert waits == [0.05, 0.0, 0.0]


# ------------------------------------------------------------------------------- replicated KV heads
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 4)])
def test_replicated_heads_are_read_once_from_one_replica_each(pools, monkeypatch, p_tp, d_tp) -> None:
    """One KV head (GQA with fewer heads than ranks): vLLM replicates it on every rank. A consumer
    rank reads it from one producer replica, never from several (no duplicate traffic), and the
    consumer ranks spread over the replicas."""
    monkeypatch.setitem(globals(), "HEADS", 1)
    full, producers, consumers = pools(p_tp, d_tp)
    ticket = stage(producers, "t-rep", kvparams.new_token())
    assert all(v is None for v in load(consumers, ticket).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, d_tp, r), f"consumer rank {r}"
    rows = LAYERS * len(CONSUMER_IDS) * consumers[0].geometry.block_bytes
    read = [w.totals.data["bytes_by_path"]["tcp"] for w in consumers]
    assert read == [rows] * d_tp, read  # each consumer rank: its one head's rows, once
    served = [w.server.counters.bytes_sent for w in producers]
    assert sum(served) == d_tp * rows and sum(1 for b in served if b) == min(p_tp, d_tp), served


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 4)])
def test_an_mla_latent_is_served_by_producer_rank_0_to_every_consumer_rank(pools, monkeypatch, p_tp, d_tp) -> None:
    """MLA: one latent per layer, the same on every rank; producer rank 0 serves all consumer ranks."""
    import kvconnectors.tiered.worker as worker

    monkeypatch.setitem(globals(), "HEADS", 1)
    monkeypatch.setattr(worker, "_attention_backend", lambda vllm_config: "FLASHMLA")
    full, producers, consumers = pools(p_tp, d_tp)
    assert all(w.geometry.mla for w in producers + consumers)
    ticket = stage(producers, "t-mla", kvparams.new_token())
    assert all(v is None for v in load(consumers, ticket).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, d_tp, r), f"consumer rank {r}"
    rows = LAYERS * len(CONSUMER_IDS) * consumers[0].geometry.block_bytes
    assert [w.server.counters.bytes_sent for w in producers] == [d_tp * rows] + [0] * (p_tp - 1)


# ------------------------------------------------------------------------------- push mode
def push_pools(pools, p_tp: int, d_tp: int, **consumer_cfg):
    """Consumers in push mode: rank r's landing store on base + r; returns (..., push_target)."""
    from kvconnectors.serving import free_port_block

    base = free_port_block(d_tp)
    full, producers, consumers = pools(p_tp, d_tp, consumer_cfg={"transfer_mode": "push", "store_port": base,
                                                                 **consumer_cfg})
    return full, producers, consumers, f"127.0.0.1:{base}"


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 4)])
def test_pushes_to_a_larger_tp_size_land_each_consumer_ranks_heads(pools, p_tp, d_tp) -> None:
    """D TP >= P TP: each producer rank packs, per consumer rank it serves, that rank's heads into
    that rank's rows and pushes them under that rank's rows fingerprint; each consumer rank loads
    its landed copy (nothing pulled), and the producer lets go of its copy once every rank has it."""
    full, producers, consumers, target = push_pools(pools, p_tp, d_tp)
    ticket = stage(producers, "t-push", kvparams.new_token(), push_target=target)
    assert all(v is None for v in load(consumers, ticket).values())
    rows = LAYERS * len(CONSUMER_IDS) * consumers[0].geometry.block_bytes
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, d_tp, r), f"consumer rank {r}"
        assert w.totals.data["bytes_by_path"] == {"push_tcp": rows}, w.totals.data["bytes_by_path"]
        assert w.landing.entries.counters["landed"] == 1 and w.store.usage()["entries"] == 0
    assert all(w.store.usage()["entries"] == 0 for w in producers), "a producer kept its copy after every rank landed it"
    assert sum(w.totals.data["bytes_pushed"] for w in producers) == d_tp * rows  # each rank's heads, once
    assert not any(w.totals.data["failures"] for w in producers + consumers)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])
def test_a_corrupted_landed_slice_changes_what_the_consumer_rank_loads(pools, p_tp, d_tp) -> None:
    """Negative control on the same data path: the landed copy (P1 -> D2) or fragments (P2 -> D1)
    flipped on their way into the blocks."""
    from kvconnectors.transport import tamper

    full, producers, consumers, target = push_pools(pools, p_tp, d_tp, test_hooks=True)
    ticket = stage(producers, tamper.mark("t-flip", "corrupt_landed"), kvparams.new_token(), push_target=target)
    assert all(v is None for v in load(consumers, ticket).values())
    assert not any(loaded_equals_reference(full, w, d_tp, r) for r, w in enumerate(consumers))
    assert all(w.totals.data["bytes_by_path"].get("push_tcp") for w in consumers)


@pytest.mark.parametrize("p_tp", [2, 4])
def test_pushes_to_a_smaller_tp_size_land_head_fragments_the_consumer_rank_assembles(pools, p_tp) -> None:
    """D TP < P TP: every producer rank the consumer rank's plan names pushes its heads as a
    fragment under its own id (P4: heads replicated on two ranks each, one replica pushes); the
    consumer rank assembles them (nothing pulled), the producer ranks let their copies go, and
    every fragment's landing entry is gone after the load."""
    from kvconnectors.tiered.tp import fragment_id

    full, producers, consumers, target = push_pools(pools, p_tp, 1)
    ticket = stage(producers, "t-frag", kvparams.new_token(), push_target=target)
    (w,) = consumers
    assert sorted(w.store.keys()) == [fragment_id("t-frag", r) for r in range(0, p_tp, p_tp // 2)]  # sealed
    assert all(v is None for v in load(consumers, ticket).values())
    assert loaded_equals_reference(full, w, 1, 0)
    rows = LAYERS * len(CONSUMER_IDS) * w.geometry.block_bytes
    assert w.totals.data["bytes_by_path"] == {"push_tcp": rows}, w.totals.data["bytes_by_path"]
    assert w.landing.entries.counters["landed"] == 2 and w.store.usage()["entries"] == 0
    serving = range(0, p_tp, p_tp // 2)  # (the others' copies go when the consumer's scheduler releases them)
    assert all(producers[r].store.usage()["entries"] == 0 for r in serving), "a producer kept its copy after it landed"
    assert sum(p.totals.data["bytes_pushed"] for p in producers) == rows  # each head once
    assert not any(x.totals.data["failures"] for x in producers + consumers)


def test_a_failed_fragment_load_fails_typed_and_leaves_no_fragment_behind(pools) -> None:
    """Rank 1's fragment refused (its producer keeps its copy) and rank 1 then gone: the pull of its
    slice fails the load, typed and naming the rank, and rank 0's landed fragment, kept while a
    retry could still use it, is freed with the final failure."""
    full, producers, consumers, target = push_pools(pools, 2, 1)
    (w,) = consumers
    take = w.landing.receiver._fragment_rows
    w.landing.receiver._fragment_rows = lambda a, b: (_ for _ in ()).throw(ValueError("no")) if a == 1 else take(a, b)
    ticket = stage(producers, "t-gone", kvparams.new_token(), push_target=target)
    producers[1].server.close()
    err = load(consumers, ticket)[0]
    assert err is not None and err.cause is FailureCause.PEER_UNREACHABLE and "producer rank 1 of 2" in err.detail, err
    assert w.store.usage()["entries"] == 0, w.store.keys()


def test_a_fragment_that_fills_other_heads_than_the_plan_says_is_never_loaded(pools) -> None:
    """A fragment whose landed head range is not what this rank's plan takes from that producer rank
    (another version's plan) is refused: the load pulls it instead and, its producer having let go of
    its copy, fails typed; wrong heads never reach the cache as if they were right."""
    full, producers, consumers, target = push_pools(pools, 2, 1)
    (w,) = consumers
    heads_of = w.landing.entries.heads_of
    w.landing.entries.heads_of = lambda key: (1, 2) if key.endswith("rank0") else heads_of(key)
    ticket = stage(producers, "t-heads", kvparams.new_token(), push_target=target)
    err = load(consumers, ticket)[0]
    assert err is not None and "producer rank 0 of 2" in err.detail, err
    assert w.totals.data["push_fallbacks"] == 1 and w.store.usage()["entries"] == 0


def test_a_dropped_request_lets_go_of_its_landed_fragments(pools) -> None:
    """Aborted before its load (the scheduler's drop): every fragment's landing entry goes at once."""
    full, producers, consumers, target = push_pools(pools, 2, 1)
    stage(producers, "t-drop", kvparams.new_token(), push_target=target)
    (w,) = consumers
    assert w.store.usage()["entries"] == 2
    w.drop(["t-drop"])
    assert w.store.usage()["entries"] == 0


def test_a_refused_fragment_is_pulled_from_its_producer_rank_and_the_landed_one_used(pools) -> None:
    """P2 -> D1 with the landing side refusing producer rank 1's fragment in step: rank 0's fragment
    lands and is used (its producer let its copy go), rank 1's slice is pulled from rank 1, which
    kept its copy; the blocks are still byte-exact."""
    full, producers, consumers, target = push_pools(pools, 2, 1)
    (w,) = consumers
    take = w.landing.receiver._fragment_rows

    def refuse_second_head(start: int, stop: int) -> tuple[str, int]:
        if start == 1:
            raise ValueError("refused by the test")
        return take(start, stop)
    w.landing.receiver._fragment_rows = refuse_second_head
    ticket = stage(producers, "t-refuse", kvparams.new_token(), push_target=target)
    assert [p.store.usage()["entries"] for p in producers] == [0, 1]
    assert producers[1].totals.data["failures"] == {"push_layout_mismatch": 1}
    assert all(v is None for v in load(consumers, ticket).values())
    assert loaded_equals_reference(full, w, 1, 0)
    half = LAYERS * len(CONSUMER_IDS) * w.geometry.block_bytes // 2
    assert w.totals.data["bytes_by_path"] == {"push_tcp": half, "tcp": half}, w.totals.data["bytes_by_path"]
    assert w.totals.data["push_fallbacks"] == 1 and w.store.usage()["entries"] == 0


def test_a_refused_slice_push_keeps_the_producer_copy_for_that_rank_to_pull(pools) -> None:
    """P1 -> D2 with consumer rank 1's landing store refusing the push in step (its rows fingerprint
    changed under it: layout_mismatch): rank 0 lands its push, rank 1 pulls its slice, and the
    producer keeps its copy after the landed route, for that pull."""
    full, producers, consumers, target = push_pools(pools, 1, 2)
    consumers[1].landing.receiver.fingerprint = "0" * 16
    ticket = stage(producers, "t-refused", kvparams.new_token(), push_target=target)
    assert producers[0].store.usage()["entries"] == 1, "the producer let go although a rank was refused"
    assert producers[0].totals.data["failures"] == {"push_layout_mismatch": 1}
    assert all(v is None for v in load(consumers, ticket).values())
    for r, w in enumerate(consumers):
        assert loaded_equals_reference(full, w, 2, r), f"consumer rank {r}"
    assert set(consumers[0].totals.data["bytes_by_path"]) == {"push_tcp"}
    assert set(consumers[1].totals.data["bytes_by_path"]) == {"tcp"}
    assert consumers[1].totals.data["push_fallbacks"] == 1


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 1), (2, 2)])
def test_a_producer_rank_derives_each_consumer_ranks_rows_fingerprint(physical, p_tp, d_tp) -> None:
    """What a sliced push presents must be what that consumer rank's landing store checks."""
    for p in range(p_tp):
        for c in range(d_tp):
            assert layout(p_tp, p, physical=physical).for_rank(d_tp, c).rows_fingerprint == layout(
                d_tp, c, physical=physical).rows_fingerprint, (p, c)


def test_push_routes_per_tp_pairing() -> None:
    from kvconnectors.mover.heads import HeadRange
    from kvconnectors.mover.reslice import geometry_row_layout
    from kvconnectors.mover.shapes import synthetic_caches as caches_of
    from kvconnectors.tiered.layout import detect_layout as detect
    from kvconnectors.tiered.tp import PushRoute, push_routes

    def side(tp: int, rank: int):
        lay, geometry = detect(caches_of("LBHNC", num_layers=LAYERS, num_blocks=BLOCKS,
                                         heads=head_map(HEADS, tp)[rank].count, block_size=BS, content=C,
                                         dtype=torch.float32, device="meta"),
                               BS, "LBHNC", tp_size=tp, tp_rank=rank, model="tiny", backend="FLASH_ATTN",
                               total_kv_heads=HEADS)
        return lay, geometry_row_layout(geometry)

    lay, row = side(1, 0)  # one rank with both heads -> a TP-2 decode: one head each, packed
    assert push_routes(lay, row, "h", 7000, 2) == [
        PushRoute(("h", 7000), HeadRange(0, 1), side(2, 0)[0].rows_fingerprint),
        PushRoute(("h", 7001), HeadRange(1, 2), side(2, 1)[0].rows_fingerprint)]
    assert push_routes(lay, row, "h", 7000, 1) == [PushRoute(("h", 7000))]  # equal TP: as before
    lay, row = side(2, 1)
    assert push_routes(lay, row, "h", 7000, 4) == [PushRoute(("h", 7000 + c), None, side(4, c)[0].rows_fingerprint)
                                                   for c in (2, 3)]  # its one head, whole rows
    # a TP-1 decode: its one rank's second head, as a fragment of that many heads (here its whole row)
    one = side(1, 0)[0]
    assert push_routes(lay, row, "h", 7000, 1) == [
        PushRoute(("h", 7000), HeadRange(0, 1), one.with_heads(1).rows_fingerprint, HeadRange(1, 2))]
    # rows of one head at TP 1 are not rows of one head at TP 2: a fragment is never taken for whole rows
    assert one.with_heads(1).rows_fingerprint not in (lay.rows_fingerprint, one.rows_fingerprint)
    with pytest.raises(TransferError, match="need head-sliced rows") as exc:
        push_routes(lay, UnsupportedKVCache("layout X"), "h", 7000, 4)
    assert exc.value.cause is FailureCause.LAYOUT_MISMATCH


def test_a_decode_instances_tp_size_is_asked_once_and_a_failed_ask_is_remembered_briefly(monkeypatch) -> None:
    from kvconnectors.tiered import pushes as pr

    now = [100.0]
    monkeypatch.setattr(pr.time, "monotonic", lambda: now[0])
    answers = {("a", 1): 2, ("b", 1): 0}
    asked = []

    def ask(host, port):
        asked.append((host, port))
        if (host, port) not in answers:
            raise TransferError(FailureCause.PEER_UNREACHABLE, "down")
        return answers[(host, port)]
    sizes = pr.ConsumerSizes(ask, default=1)
    assert [sizes.tp_size("a", 1), sizes.tp_size("a", 1), sizes.tp_size("b", 1)] == [2, 2, 1]  # 0: not said -> ours
    for _ in range(2):
        with pytest.raises(TransferError):
            sizes.tp_size("c", 1)
    assert asked == [("a", 1), ("b", 1), ("c", 1)]
    now[0] += pr.UNREACHABLE_TTL_S + 0.1
    answers[("c", 1)] = 2
    assert sizes.tp_size("c", 1) == 2 and asked[-1] == ("c", 1)


def test_each_producer_ranks_shm_arena_is_the_one_its_ticket_names(pools) -> None:
    """Issue 34, row 6: the consumer copies rank r's KV only out of the arena the ticket names for
    rank r (shm_paths, as the scheduler writes them). Control: the same ticket with the two ranks'
    arenas swapped fails the load (protocol, naming the arena) and lands nothing."""
    shm = {"transport": "shm"}
    full, producers, consumers = pools(2, 1, producer_cfg=shm, consumer_cfg=shm)
    arenas = [w.get_handshake_metadata().shm_path for w in producers]
    assert all(arenas) and arenas[0] != arenas[1]
    swapped = stage(producers, "t-swapped", kvparams.new_token())
    swapped["shm_paths"] = arenas[::-1]
    before = [consumers[0].geometry.views[i][CONSUMER_IDS].clone() for i in range(LAYERS)]
    err = load(consumers, swapped)[0]
    assert err is not None and err.cause is FailureCause.PROTOCOL and "not the arena its ticket names" in err.detail, err
    assert all(torch.equal(b, consumers[0].geometry.views[i][CONSUMER_IDS]) for i, b in enumerate(before))
    right = stage(producers, "t-named", kvparams.new_token())
    right["shm_paths"] = arenas
    assert load(consumers, right)[0] is None
    assert loaded_equals_reference(full, consumers[0], 1, 0)
    assert consumers[0].totals.data["bytes_by_path"].get("shm", 0) > 0


def test_the_store_servers_limits_are_settings(pools) -> None:
    """Issue 34, row 5: the admission caps and the handshake deadline come from the connector's
    settings (server_*), down to the worker's store server."""
    cfg = {"server_max_connections": 40, "server_max_per_peer": 12, "server_max_pending": 10,
           "server_handshake_timeout_s": 0.5}
    _, producers, _ = pools(1, 1, producer_cfg=cfg)
    srv = producers[0].server
    caps = srv.admission.caps
    assert (caps.max_connections, caps.max_per_peer, caps.max_pending, caps.pending_per_peer,
            caps.pending_per_prefix) == (40, 12, 10, 5, 5)
    assert srv.handshake_timeout_s == 0.5
