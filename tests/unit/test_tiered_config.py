"""TieredConnector settings and ticket validation (no engine)."""

from __future__ import annotations

import pytest

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.config import TieredConfig


def test_defaults() -> None:
    cfg = TieredConfig.from_extra({})
    assert (cfg.transport, cfg.lease_ttl_s, cfg.heartbeat_interval_s, cfg.advertise_host) == ("tcp", 30.0, 10.0,
                                                                                                "127.0.0.1")
    assert cfg.dram_bytes == 2**30


@pytest.mark.parametrize("extra, key", [
    ({"transport": "udp"}, "transport"),
    ({"transfer_mode": "stream"}, "transfer_mode"),
    ({"layer_group_size": 0}, "layer_group_size"),
    ({"layer_group_size": True}, "layer_group_size"),
    ({"layerwise_min_tokens": -1}, "layerwise_min_tokens"),
    ({"layerwise_min_tokens": "256"}, "layerwise_min_tokens"),
    ({"lease_ttl_s": -1}, "lease_ttl_s"),
    ({"lease_ttl_s": 0}, "lease_ttl_s"),
    ({"lease_ttl_s": float("nan")}, "lease_ttl_s"),
    ({"dram_bytes": "8x"}, "dram_bytes"),
    ({"dram_bytes": -5}, "dram_bytes"),
    ({"bind_host": "0.0.0.0"}, "advertise_host"),
    ({"bind_host": "not a host!"}, "bind_host"),
    ({"store_port": 70000}, "store_port"),
    ({"store_port": "80"}, "store_port"),
    ({"heartbeat_interval_s": 40}, "heartbeat_interval_s"),
    ({"nvme_bytes": "1g"}, "nvme_bytes"),
    ({"checksum": "yes"}, "checksum"),
    ({"max_concurrent_loads": 0}, "max_concurrent_loads"),
    ({"fault_injection": [{"action": "explode"}]}, "fault_injection"),
    ({"lease_ttl": 30}, "lease_ttl"),  # a typo is an error, not a silently ignored setting
])
def test_bad_settings_name_the_key_and_value(extra, key) -> None:
    with pytest.raises(ConfigError) as err:
        TieredConfig.from_extra(extra)
    assert err.value.key == key, err.value
    assert key in str(err.value) and repr(next(iter(extra.values())))[:10] in str(err.value)


def test_sizes_are_human_readable() -> None:
    assert TieredConfig.from_extra({"dram_bytes": "512MiB"}).dram_bytes == 512 * 2**20
    assert TieredConfig.from_extra({"dram_bytes": "1.5GB"}).dram_bytes == 1_500_000_000


def _ticket(prompt: list[int]) -> dict:
    p = kvparams.TransferParams(v=kvparams.PARAMS_VERSION, transfer_id="e:r1", addrs=[kvparams.PeerAddress("127.0.0.1", 5000)],
                                num_tokens=len(prompt), num_blocks=-(-len(prompt) // 32), block_size=32,
                                fingerprint="f" * 16, prompt_hash=kvparams.prompt_hash(prompt), lease_ttl_s=30.0,
                                issued_at=0.0, token=kvparams.new_token(), tp_size=1, kv_heads=2)
    return kvparams.producer_params(p, "engine")


def test_ticket_round_trip() -> None:
    prompt = list(range(70))
    t = _ticket(prompt)
    assert t["do_remote_prefill"] and t["remote_port"] == 5000
    assert kvparams.parse(t, prompt, 32).transfer_id == "e:r1"


@pytest.mark.parametrize("mutate, cause, needle", [
    (lambda k: k.pop("fingerprint"), FailureCause.BAD_PARAMS, "fingerprint"),
    (lambda k: k.update(num_blocks="3"), FailureCause.BAD_PARAMS, "num_blocks"),
    (lambda k: k.update(num_tokens=10**12, num_blocks=10**12 // 32), FailureCause.BAD_PARAMS, "num_tokens"),
    (lambda k: k.update(addrs=[["127.0.0.1", 0]]), FailureCause.BAD_PARAMS, "addrs"),
    (lambda k: k.update(block_size=16, num_blocks=5), FailureCause.LAYOUT_MISMATCH, "block_size"),
    (lambda k: k.update(v=99), FailureCause.BAD_PARAMS, "v=99"),
    (lambda k: k.update(evil="__import__('os')"), FailureCause.BAD_PARAMS, "evil"),
    (lambda k: k.update(push_target=7), FailureCause.BAD_PARAMS, "push_target"),
])
def test_malformed_tickets_are_typed_and_name_the_field(mutate, cause, needle) -> None:
    prompt = list(range(70))
    t = _ticket(prompt)
    mutate(t[kvparams.KEY])
    with pytest.raises(TransferError) as err:
        kvparams.parse(t, prompt, 32)
    assert err.value.cause is cause and needle in str(err.value), err.value


def test_ticket_for_another_prompt_is_refused() -> None:
    t = _ticket(list(range(70)))
    with pytest.raises(TransferError, match="prompt_hash"):
        kvparams.parse(t, list(range(1, 71)), 32)
    with pytest.raises(TransferError, match="num_tokens"):
        kvparams.parse(t, list(range(71)), 32)


def test_push_mode_asks_vllm_for_piecewise_cuda_graphs() -> None:
    """save_kv_layer does work between layers in push mode: a full captured graph would skip it."""
    from kvconnectors.tiered.connector import TieredConnector

    assert TieredConnector.requires_piecewise_for_cudagraph({"transfer_mode": "push"})
    assert not TieredConnector.requires_piecewise_for_cudagraph({"transfer_mode": "pull"})
    assert not TieredConnector.requires_piecewise_for_cudagraph({})
    # role-aware: a push decode instance keeps full graphs; any instance can force piecewise
    assert not TieredConnector.requires_piecewise_for_cudagraph({"transfer_mode": "push",
                                                                 "cudagraph_piecewise": "off"})
    assert TieredConnector.requires_piecewise_for_cudagraph({"cudagraph_piecewise": "on"})
    with pytest.raises(ConfigError, match="cudagraph_piecewise"):
        TieredConnector.requires_piecewise_for_cudagraph({"cudagraph_piecewise": "sometimes"})


def test_the_connector_asks_for_the_layout_that_moves_fastest() -> None:
    """Layer-first, head-major blocks (one run per block, NIXL's choice too); MLA: no preference."""
    from types import SimpleNamespace

    from kvconnectors.tiered.connector import TieredConnector

    assert TieredConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=False))) \
        == "LBHNC"
    assert TieredConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=True))) \
        is None


def test_push_with_tensor_parallelism_needs_a_fixed_store_port() -> None:
    from types import SimpleNamespace

    from kvconnectors.errors import ConfigError
    from kvconnectors.tiered.config import TieredConfig
    from kvconnectors.tiered.worker import TieredConnectorWorker

    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True),
        cache_config=SimpleNamespace(block_size=16), parallel_config=SimpleNamespace(tensor_parallel_size=2),
        model_config=SimpleNamespace(served_model_name="m"))
    with pytest.raises(ConfigError, match="store_port"):
        TieredConnectorWorker(vllm_config, TieredConfig(transfer_mode="push"), "e")
