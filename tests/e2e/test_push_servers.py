"""Push mode between two live `vllm serve` processes: the prefill instance streams layer groups of
an 8-layer model into the decode instance's landing store while later layers compute."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import CPU_DEFAULT_ARGS, complete
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts
from kvconnectors.testing.metrics import total
from kvconnectors.transport.client import store_status

MAX_MODEL_LEN = int(CPU_DEFAULT_ARGS[CPU_DEFAULT_ARGS.index("--max-model-len") + 1])  # what PDCluster starts with

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32
# short prompts (sent in one message) and long ones (layer-wise, above layerwise_min_tokens)
LENGTHS = (block_edge_lengths(BLOCK) + [300, 700, 1200, 2000]) * 2
MAX_TOKENS = 10
CONCURRENCY = 8
PUSH = {"layer_group_size": 2, "layerwise_min_tokens": 256}
CONTROL_LENGTHS = control_lengths(BLOCK) + [300]  # block boundaries (bulk push) and one layer-wise


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    assert len(LENGTHS) >= 20
    return token_prompts(LENGTHS, seed=23)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=24)


@pytest.fixture(scope="module")
def colocated(deep_model: str, prompts: list[list[int]], control_prompts: list[list[int]]) -> list[list[int]]:
    """Colocated outputs of `prompts`, then of `control_prompts`."""
    with llm_engine(deep_model) as llm:
        return generate_ids(llm, prompts + control_prompts, MAX_TOKENS)


def run_requests(pd: PDCluster, prompts: list[list[int]], **extra) -> list[dict]:
    name = pd.prefill[0].served_model_name

    def one(p: list[int]) -> dict:
        return complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS, timeout=180, **extra)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, prompts))


def run_workload(pd: PDCluster, prompts: list[list[int]]) -> list[list[int]]:
    return [list(r["choices"][0]["token_ids"]) for r in run_requests(pd, prompts)]


def assert_corrupted_pushes_change_output(pd: PDCluster, control_prompts, expected, fault: str, what: str) -> None:
    """Negative control on the running pair: pushes the test hooks corrupt (`fault`) complete
    normally and decode other tokens."""
    outs = run_requests(pd, control_prompts, kv_transfer_params={"kvc_fault": fault})
    assert_control_changed(expected, [list(r["choices"][0]["token_ids"]) for r in outs],
                           [r["choices"][0]["finish_reason"] for r in outs], CONTROL_LENGTHS, what=what)


def stores_empty(pd: PDCluster, timeout: float = 10.0) -> list:
    """Both stores (producer staging, consumer landing) hold nothing once every request is done."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = [store_status(host, int(port)) for host, port in (p.kv_addr.rsplit(":", 1) for p in pd.plans)]
        if all(s.entries == 0 and s.dram_used_bytes == 0 for s in statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)




@pytest.mark.parametrize("transport, vllm_args, spill", [
    # long prompts prefilled over several steps: groups of each step's whole blocks go out as staged
    # (one-step prefills are pushed over tcp across hosts, test_hosts_servers, and through Ray)
    ("tcp", "--max-num-batched-tokens 512 --max-num-seqs 8", True), ("nixl", "", False),
], ids=["tcp-chunked-spilling", "nixl"])
def test_push_servers_equal_colocated(deep_model, prompts, control_prompts, colocated, transport, vllm_args, spill,
                                     tmp_path) -> None:
    """Identity in push mode with every loaded byte landed over the push path of `transport`;
    then two negative controls on the same servers: pushes corrupted where they land (the
    landing side's receive, checksum skipped) and landed copies corrupted on their way into the
    KV blocks. Seen to fail: with tamper.corrupt made a no-op both report 'decoded identically'.
    `spill`: DRAM budgets far below the workload on both sides: the prefill stages long prompts
    onto NVMe (pushed from there), the decode lands them partly on NVMe, and attributes the
    NVMe-held part of the prompts to `disk` (the other cases land in DRAM only)."""
    extra: dict = {**PUSH, "test_hooks": True}
    if spill:
        extra.update(dram_bytes="2MiB", nvme_dirs=[str(tmp_path / "nvme")], nvme_bytes="512MiB",
                     nvme_create_dirs=True)
    n = len(prompts)
    with PDCluster(deep_model, transport=transport, mode="push", kv_extra={"kv_connector_extra_config": extra},
                   vllm_args=vllm_args, proxy_args=["--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"],
                   log_dir=tmp_path / "logs") as pd:
        assert_same_tokens(colocated[:n], run_workload(pd, prompts))
        statuses = stores_empty(pd)
        assert all(s.entries == 0 and s.dram_used_bytes == 0 and s.nvme_used_bytes == 0 for s in statuses), statuses
        for fault in ("corrupt", "corrupt_landed"):
            assert_corrupted_pushes_change_output(pd, control_prompts, colocated[n:], fault,
                                                  f"{fault} pushes over {transport}" + (" (NVMe tiers)" if spill else ""))
        statuses = stores_empty(pd)
        assert all(s.entries == 0 and s.nvme_used_bytes == 0 for s in statuses), statuses
        # The stores' accounting (above) shows the NVMe space given back. On disk there is no name
        # to look for, even after vLLM SIGKILLs its workers: an extent file's name is removed as
        # soon as it is open, which is what this checks.
        assert not list((tmp_path / "nvme").glob("kvc-*.kv")), "extent files keep a name while in use"
        run_workload(pd, prompts[:1])  # one more step reports the last interval's stats
        p, d = pd.prefill[0].metrics(), pd.decode[0].metrics()
    assert total(p, "kvconnectors:pushes_total") >= len(prompts), "transfers were not pushed"
    assert total(p, "kvconnectors:pushed_bytes_total") > 0
    assert total(d, "kvconnectors:push_fallbacks_total") == 0, "pushed KV did not land; the decode pulled it"
    assert total(d, "kvconnectors:transfers_total") >= len(prompts) + 2 * len(control_prompts)
    path = f"push_{transport}"
    moved = {lab.get("path"): v for lab, v in d.get("kvconnectors:transfer_bytes_total", []) if v}
    assert set(moved) == {path}, f"KV bytes by data path {moved}: expected every byte landed over {path}"
    # the decode read the prompts' KV from its own host-memory landing store
    assert total(d, "vllm:prompt_tokens_cached_by_source_total", source="host") > 0
    from_disk = (total(d, "vllm:prompt_tokens_cached_by_source_total", source="disk"),
                 total(p, "kvconnectors:store_hits_nvme_total"))
    if spill:
        assert all(v > 0 for v in from_disk), f"(decode tokens from disk, prefill NVMe hits) = {from_disk}"
    else:
        assert from_disk == (0, 0), f"(decode tokens from disk, prefill NVMe hits) = {from_disk} with DRAM tiers"


def test_decode_hanging_up_mid_push_fails_loudly_and_recompute_heals(deep_model, prompts, colocated,
                                                                     tmp_path) -> None:
    """The landing side drops the producer's connection in the middle of a push: every transfer
    open on it fails (the producer stops, releases its copy and records why); the decode's loads
    fail with peer_unreachable and vLLM recomputes them (kv_load_failure_policy recompute)."""
    kv = {"kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {**PUSH, "fault_injection": [{"action": "truncate", "on": "push", "nth": 5}]}}
    with PDCluster(deep_model, transport="tcp", mode="push", kv_extra=kv, log_dir=tmp_path) as pd:
        assert_same_tokens(colocated[:len(prompts)], run_workload(pd, prompts))
        statuses = stores_empty(pd)
        assert all(s.entries == 0 for s in statuses), statuses
        run_workload(pd, prompts[:1])
        p, d = pd.prefill[0].metrics(), pd.decode[0].metrics()
    assert total(p, "kvconnectors:transfer_failures_total", cause="push_peer_unreachable") >= 1
    assert total(d, "kvconnectors:transfer_failures_total", cause="peer_unreachable") >= 1


def test_refused_pushes_fall_back_to_pull_also_when_queued_past_the_lease_ttl(deep_model, prompts, colocated,
                                                                            tmp_path) -> None:
    """Pushed requests wait in the decode's queue for longer than lease_ttl_s (the decode serves one
    sequence at a time and is busy with a long generation): its lease keeper renews their landed
    copies, so they load and equal colocated instead of failing lease_expired. The first push is
    found corrupted on arrival and refused (checksum mismatch, answered in step): the prefill keeps
    its staged copy, the keeper renews that one too, and the decode pulls it. Then one prompt of each
    length at concurrency 8 through the one-sequence decode, with the same short TTL."""
    ttl = 3.0  # (2 s lapsed once on a loaded 2-core CI host, before renewals ran per producer)
    kv = {"kv_connector_extra_config": {**PUSH, "lease_ttl_s": ttl, "heartbeat_interval_s": 0.5,
                                        "fault_injection": [{"action": "corrupt", "on": "push", "times": 1}]}}
    long_ids = [i for i, n in enumerate(LENGTHS) if n >= PUSH["layerwise_min_tokens"]][:3]
    with PDCluster(deep_model, transport="tcp", mode="push", kv_extra=kv, vllm_args="--max-num-seqs 1",
                   log_dir=tmp_path) as pd:
        dec = pd.decode[0]
        t0 = time.monotonic()
        dec.complete(prompts[0], max_tokens=200, timeout=120)  # straight to the decode: no push
        per_token = (time.monotonic() - t0) / 200
        # the blocker runs >= 5 x the TTL, within the servers' context (a faster host measures a smaller
        # per_token: 3,500 tokens after a 16-token prompt were refused 400 by a 2,048-token server)
        busy_tokens = min(MAX_MODEL_LEN - 16, int(5 * ttl / per_token) + 1)
        with ThreadPoolExecutor(1 + len(long_ids)) as pool:
            blocker = pool.submit(dec.complete, prompts[1][:16], max_tokens=busy_tokens, timeout=300)
            time.sleep(0.5)  # the blocker holds the decode's only sequence slot
            start = time.monotonic()
            outs = list(pool.map(lambda i: run_workload(pd, [prompts[i]])[0], long_ids))
            waited = time.monotonic() - start
            blocker.result()
        assert waited > 2 * ttl, f"the pushed requests did not queue past the lease TTL ({waited:.1f} s)"
        assert_same_tokens([colocated[i] for i in long_ids], outs)

        distinct = len(LENGTHS) // 2  # LENGTHS is every length twice: one of each is enough here
        assert_same_tokens(colocated[:distinct], run_workload(pd, prompts[:distinct]))
        statuses = stores_empty(pd)
        assert all(s.entries == 0 for s in statuses), statuses
        d = dec.metrics()
    assert total(d, "kvconnectors:transfer_failures_total") == 0
    assert total(d, "kvconnectors:push_fallbacks_total") == 1, "the refused push was not pulled instead"
