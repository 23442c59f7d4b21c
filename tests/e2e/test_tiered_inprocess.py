"""TieredConnector end to end on a real in-process vLLM engine (kv_both: prefill leg, then
decode leg pulling over the real transport from the engine's own store server)."""

from __future__ import annotations

import os
import time

import pytest

from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, generate_outputs, llm_engine
from kvconnectors.testing.pd import assert_engine_idle, decode, prefill, worker_connector
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BLOCK = 32
LENGTHS = (block_edge_lengths(BLOCK) * 4)[:20]   # under a block, exactly one, many: 20 prompts
MAX_TOKENS = 10


def tiered(transport: str = "tcp", policy: str = "fail", **extra) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "kvconnectors.tiered",
            "kv_role": "kv_both", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"transport": transport, "dram_bytes": "64m", **extra}}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS, seed=7)


CONTROL_LENGTHS = control_lengths(BLOCK)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=8)


@pytest.fixture(scope="module")
def colocated(tiny_model: str, prompts: list[list[int]], control_prompts: list[list[int]]) -> list[list[int]]:
    """Colocated outputs of `prompts`, then of `control_prompts`."""
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts + control_prompts, MAX_TOKENS)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_handoff_equals_colocated(tiny_model, prompts, control_prompts, colocated, transport) -> None:
    """Identity over `transport`, every byte carried by it, and on the same engine and path a
    negative control: prompts at block boundaries whose KV is silently corrupted where the path
    delivers it (test hook, checksum skipped for them) complete normally with other tokens.
    Seen to fail: with tamper.corrupt made a no-op the control reports 'decoded identically'."""
    cfg = tiered(transport, test_hooks=True)
    with llm_engine(tiny_model, kv_transfer_config=cfg) as llm:
        tickets = prefill(llm, prompts)
        assert all(t and t.get("do_remote_prefill") for t in tickets), tickets[:2]
        w = worker_connector().connector_worker
        # The producer holds no engine blocks once staged; the store serves every prompt.
        assert_engine_idle(llm)
        assert w.store.usage()["entries"] == len(prompts), w.store.usage()
        outs = decode(llm, prompts, tickets, MAX_TOKENS)
        assert_same_tokens(colocated[:len(prompts)], [list(o.outputs[0].token_ids) for o in outs])
        assert_engine_idle(llm)
        assert w.store.usage()["entries"] == 0, f"store not empty after release: {w.store.usage()}"
        stats = w.totals.data
        assert stats["transfers"] == len(prompts) and not stats["failures"], stats
        assert set(stats["bytes_by_path"]) == {transport} and stats["bytes_by_path"][transport] > 0, stats
        assert not stats["path_fallbacks"], stats["path_fallbacks"]

        assert_corrupted_pulls_change_output(llm, control_prompts, colocated[len(prompts):],
                                             f"corrupted {transport} pulls")
        assert set(w.totals.data["bytes_by_path"]) == {transport}, w.totals.data["bytes_by_path"]
        assert_engine_idle(llm)
        assert w.store.usage()["entries"] == 0


def assert_corrupted_pulls_change_output(llm, control_prompts, expected, what: str) -> None:
    """The negative control on the engine at hand (needs test_hooks): silently corrupted pulls of
    block-boundary prompts complete normally and decode other tokens."""
    outs = decode(llm, control_prompts, prefill_marked(llm, control_prompts, "corrupt"), MAX_TOKENS)
    assert_control_changed(expected, [list(o.outputs[0].token_ids) for o in outs],
                           [o.outputs[0].finish_reason for o in outs], CONTROL_LENGTHS, what=what)


def prefill_marked(llm, prompts: list[list[int]], fault: str) -> list[dict | None]:
    """Prefill legs whose transfers the test hooks corrupt (kv_transfer_params kvc_fault)."""
    outs = generate_outputs(llm, prompts, 1, [{"do_remote_decode": True, "kvc_fault": fault}] * len(prompts))
    return [o.kv_transfer_params for o in outs]


def test_chunked_prefill_stages_every_block_once(tiny_model, prompts, control_prompts, colocated) -> None:
    """Prompts prefilled in 48-token chunks (not block-aligned): intermediate steps stage only the
    whole blocks, the last step the tail; the handoff still equals colocated and every block of
    every layer is staged exactly once; corrupted block-boundary prompts change (control)."""
    with llm_engine(tiny_model, kv_transfer_config=tiered(test_hooks=True), max_num_batched_tokens=48,
                    max_model_len=512) as llm:
        tickets = prefill(llm, prompts)
        stats = worker_connector().connector_worker.totals.data
        layers = worker_connector().connector_worker.layout.num_layers
        blocks = sum(-(-n // BLOCK) for n in LENGTHS)
        assert stats["blocks_staged"] == layers * blocks, (stats["blocks_staged"], layers * blocks)
        outs = decode(llm, prompts, tickets, MAX_TOKENS)
        assert_same_tokens(colocated[:len(prompts)], [list(o.outputs[0].token_ids) for o in outs])
        assert_corrupted_pulls_change_output(llm, control_prompts, colocated[len(prompts):], "chunked prefill")
        assert_engine_idle(llm)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_checksum_catches_corruption(tiny_model, prompts, colocated, policy) -> None:
    cfg = tiered(policy=policy, fault_injection=[{"action": "corrupt", "on": "read", "nth": 3}])
    with llm_engine(tiny_model, kv_transfer_config=cfg) as llm:
        tickets = prefill(llm, prompts)
        outs = decode(llm, prompts, tickets, MAX_TOKENS)
        failures = worker_connector().connector_worker.totals.data["failures"]
        assert failures == {"checksum_mismatch": 1}, failures
        assert_engine_idle(llm)
    reasons = [o.outputs[0].finish_reason for o in outs]
    decoded = [list(o.outputs[0].token_ids) for o in outs]
    if policy == "fail":
        assert reasons.count("error") == 1, reasons
        ok = [i for i, r in enumerate(reasons) if r != "error"]
        assert_same_tokens([colocated[i] for i in ok], [decoded[i] for i in ok])
    else:
        assert "error" not in reasons
        assert_same_tokens(colocated[:len(prompts)], decoded)


def test_unreachable_producer_fails_fast_and_engine_keeps_serving(tiny_model, prompts, colocated) -> None:
    with llm_engine(tiny_model, kv_transfer_config=tiered(connect_timeout_s=2.0)) as llm:
        tickets = prefill(llm, prompts[:4])
        dead = [dict(t, kvc=dict(t["kvc"], addrs=[["127.0.0.1", 9]])) for t in tickets[:2]]  # port 9: closed
        start = time.monotonic()
        outs = decode(llm, prompts[:4], dead + tickets[2:], MAX_TOKENS)
        assert time.monotonic() - start < 30
        assert [o.outputs[0].finish_reason for o in outs[:2]] == ["error", "error"]
        assert_same_tokens(colocated[2:4], [list(o.outputs[0].token_ids) for o in outs[2:]])
        failures = worker_connector().connector_worker.totals.data["failures"]
        assert failures == {"peer_unreachable": 2}, failures
        assert_engine_idle(llm)


def test_expired_lease_is_a_typed_failure(tiny_model, prompts) -> None:
    with llm_engine(tiny_model, kv_transfer_config=tiered(lease_ttl_s=1.0, heartbeat_interval_s=0.5)) as llm:
        tickets = prefill(llm, prompts[:3])
        time.sleep(2.5)  # nobody renews: the entries expire
        store = worker_connector().connector_worker.store
        assert store.usage()["entries"] == 0, store.usage()
        outs = decode(llm, prompts[:3], tickets, MAX_TOKENS)
        assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 3
        failures = worker_connector().connector_worker.totals.data["failures"]
        assert failures == {"lease_expired": 3}, failures
        assert_engine_idle(llm)


@pytest.mark.parametrize("mutate, cause", [
    (lambda t: dict(t, kvc={k: v for k, v in t["kvc"].items() if k != "fingerprint"}), "bad_params"),
    (lambda t: dict(t, kvc=dict(t["kvc"], num_blocks="many")), "bad_params"),
    (lambda t: dict(t, kvc=dict(t["kvc"], num_tokens=10**12)), "bad_params"),
    (lambda t: dict(t, kvc=dict(t["kvc"], prompt_hash="0" * 16)), "bad_params"),
    (lambda t: dict(t, kvc=dict(t["kvc"], fingerprint="feedfacefeedface")), "layout_mismatch"),
    (lambda t: dict(t, kvc=dict(t["kvc"], transfer_id="no-such-transfer")), "unknown_transfer"),
], ids=["missing-field", "wrong-type", "huge-number", "other-prompt", "wrong-layout", "unknown-id"])
def test_malformed_ticket_fails_alone(tiny_model, prompts, colocated, mutate, cause) -> None:
    with llm_engine(tiny_model, kv_transfer_config=tiered()) as llm:
        tickets = prefill(llm, prompts[3:6])
        bad = mutate(tickets[0])
        outs = decode(llm, prompts[3:6], [bad] + tickets[1:], MAX_TOKENS)
        assert outs[0].outputs[0].finish_reason == "error"
        assert_same_tokens(colocated[4:6], [list(o.outputs[0].token_ids) for o in outs[1:]])
        w = worker_connector().connector_worker
        assert w.totals.data["failures"] == {cause: 1}, w.totals.data["failures"]
        assert_engine_idle(llm)
        # A consumer that could read the ticket gives the entry back at once after failing; one whose
        # ticket was unreadable (or named another transfer) cannot, and the lease ends it.
        left = 0 if cause == "layout_mismatch" else 1
        assert w.store.usage()["entries"] == left, w.store.usage()
        if left:
            w.store.release(tickets[0]["kvc"]["transfer_id"])
        assert w.store.usage()["entries"] == 0, w.store.usage()


def test_loadable_by_name_through_the_plugin_entry_point(tiny_model, prompts, colocated) -> None:
    """After `pip install`, no kv_connector_module_path is needed (vllm.general_plugins)."""
    from importlib.metadata import entry_points

    assert any(ep.value == "kvconnectors.registry:register_with_vllm"
               for ep in entry_points(group="vllm.general_plugins")), "entry point not installed"
    cfg = {"kv_connector": "TieredConnector", "kv_role": "kv_both"}
    with llm_engine(tiny_model, kv_transfer_config=cfg) as llm:
        tickets = prefill(llm, prompts[:4])
        outs = decode(llm, prompts[:4], tickets, MAX_TOKENS)
        assert type(worker_connector()).__name__ == "TieredConnector"
    assert_same_tokens(colocated[:4], [list(o.outputs[0].token_ids) for o in outs])


@pytest.mark.parametrize("fault", [
    {"action": "corrupt", "nth": 2},
    {"action": "disconnect", "nth": 2},
    {"action": "truncate", "nth": 2},
    {"action": "drop", "nth": 2},
], ids=lambda f: f["action"])
def test_retry_heals_a_transient_fault(tiny_model, prompts, colocated, fault) -> None:
    cfg = tiered(failure_policy="retry", retries=2, retry_backoff_s=0.05, load_timeout_s=8.0,
                 fault_injection=[dict(fault, on="read", delay_s=0.1)])
    with llm_engine(tiny_model, kv_transfer_config=cfg) as llm:
        tickets = prefill(llm, prompts[:6])
        outs = decode(llm, prompts[:6], tickets, MAX_TOKENS)
        totals = worker_connector().connector_worker.totals.data
        assert totals["retries"] == 1 and not totals["failures"], totals
        assert_engine_idle(llm)
        assert worker_connector().connector_worker.store.usage()["entries"] == 0
    assert_same_tokens(colocated[:6], [list(o.outputs[0].token_ids) for o in outs])


def test_per_request_policy_must_match_the_engine(tiny_model, prompts) -> None:
    with llm_engine(tiny_model, kv_transfer_config=tiered(policy="fail")) as llm:
        tickets = prefill(llm, prompts[:2])
        bad = dict(tickets[0], failure_policy="recompute")
        outs = decode(llm, prompts[:2], [bad, tickets[1]], MAX_TOKENS)
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "length"]
        assert worker_connector().connector_worker.totals.data["failures"] == {"bad_params": 1}
        worker_connector().connector_worker.store.release(tickets[0]["kvc"]["transfer_id"])
        assert_engine_idle(llm)


def test_dram_budget_far_below_the_workload_spills_to_nvme(tiny_model, prompts, control_prompts, colocated,
                                                           tmp_path) -> None:
    """A 256 KiB DRAM tier (16 blocks of this model) for ~200 blocks of KV: most staged KV lives on
    disk; the decode outputs still equal colocated, and the store counts spills and NVMe reads;
    corrupted block-boundary prompts change (control)."""
    nvme = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    cfg = tiered(dram_bytes="256KiB", nvme_dirs=nvme, nvme_bytes="64MiB", nvme_create_dirs=True, test_hooks=True)
    with llm_engine(tiny_model, kv_transfer_config=cfg) as llm:
        tickets = prefill(llm, prompts)
        store = worker_connector().connector_worker.store
        usage = store.usage()
        assert usage["nvme"]["used_bytes"] > 4 * usage["dram"]["capacity_bytes"], usage
        outs = decode(llm, prompts, tickets, MAX_TOKENS)
        stats = store.stats.snapshot()
        assert stats["spills"] > 0 and (stats["restores"] + stats["hits_nvme"]) > 0, stats
        after = store.usage()  # the store's own accounting: the NVMe space is given back, not just the entries
        assert after["entries"] == 0 and after["nvme"]["used_bytes"] == 0, after
        # the extent files hold their space without a name: nothing can be left behind, however
        # the worker ends
        assert [os.fstat(f.lock_fd).st_nlink for f in store._nvme.files] == [0, 0]
        assert not [p for d in nvme for p in os.listdir(d)], "extent files keep a name while in use"
        assert_same_tokens(colocated[:len(prompts)], [list(o.outputs[0].token_ids) for o in outs])
        assert_corrupted_pulls_change_output(llm, control_prompts, colocated[len(prompts):], "pulls from NVMe")


def test_store_full_fails_only_what_does_not_fit(tiny_model, prompts, colocated) -> None:
    """Back-pressure: DRAM for ~2 prompts, no NVMe tier. Staging that does not fit fails with
    store_full; what was stored is served intact."""
    with llm_engine(tiny_model, kv_transfer_config=tiered(dram_bytes="640KiB")) as llm:
        tickets = prefill(llm, prompts)
        outs = decode(llm, prompts, tickets, MAX_TOKENS)
        totals = worker_connector().connector_worker.totals.data
        assert_engine_idle(llm)
        assert worker_connector().connector_worker.store.usage()["entries"] == 0
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert "error" in reasons and "length" in reasons, reasons
    assert set(totals["failures"]) <= {"store_full", "staging_store_full"}, totals["failures"]
    ok = [i for i, r in enumerate(reasons) if r == "length"]
    assert_same_tokens([colocated[i] for i in ok], [list(outs[i].outputs[0].token_ids) for i in ok])


def test_wrong_secret_is_refused_and_counted(tiny_model, prompts, colocated, tmp_path, monkeypatch) -> None:
    """The store server demands the shared secret (from a file, never the command line); a
    consumer holding another one is refused with a typed auth failure and the refusal counted."""
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple 42")
    secret.chmod(0o600)  # a world-readable secret file is refused
    with llm_engine(tiny_model, kv_transfer_config=tiered(secret_file=str(secret))) as llm:
        tickets = prefill(llm, prompts[:3])
        w = worker_connector().connector_worker
        good = w.links.secret
        monkeypatch.setattr(w.links, "secret", b"not the secret, not at all")
        outs = decode(llm, prompts[:1], tickets[:1], MAX_TOKENS)
        assert outs[0].outputs[0].finish_reason == "error"
        assert w.totals.data["failures"] == {"auth": 1}, w.totals.data["failures"]
        assert w.server.counters.auth_failures == 1
        monkeypatch.setattr(w.links, "secret", good)
        outs = decode(llm, prompts[1:3], tickets[1:3], MAX_TOKENS)
        assert_same_tokens(colocated[1:3], [list(o.outputs[0].token_ids) for o in outs])
        w.store.release(tickets[0]["kvc"]["transfer_id"])  # an unauthenticated peer cannot release it
        assert_engine_idle(llm)
        assert w.store.usage()["entries"] == 0
