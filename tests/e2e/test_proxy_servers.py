"""The P/D proxy against real `vllm serve` instances with TieredConnector: completions and chat,
streaming and not, a killed decode instance, a killed prefill instance, a client that leaves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from kvconnectors.integration.cluster import PDCluster, ProxyThread
from kvconnectors.integration.workload import run_workload
from kvconnectors.serving import VllmServer, complete, free_port, post_json, stop_all
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.metrics import failures_by_cause
from kvconnectors.testing.prompts import token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 10
PROXY_FAST = ["--health-interval", "0.5", "--unhealthy-after", "1", "--decode-idle-timeout", "20"]
CONTROL_LENGTHS = control_lengths(32)
CORRUPT = {"kv_transfer_params": {"kvc_fault": "corrupt"}}  # TieredConnector's per-request test hook


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts([20, 64, 100, 250], seed=5)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=6)


@pytest.fixture(scope="module")
def references(tiny_model, prompts, control_prompts) -> list[list[int]]:
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts + control_prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def colocated(references, prompts) -> list[list[int]]:
    return references[:len(prompts)]


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    with PDCluster(tiny_model, proxy_args=[*PROXY_FAST, "--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"],
                   kv_extra={"kv_connector_extra_config": {"test_hooks": True}},
                   log_dir=tmp_path_factory.mktemp("pd")) as cluster:
        yield cluster


def idle(server: VllmServer) -> bool:
    m = server.metrics()
    return all(v == 0 for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
               for _, v in m.get(name, []))


def wait_until(pred, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_completions_non_streaming_and_streaming(pd, prompts, colocated) -> None:
    name = pd.prefill[0].served_model_name
    plain = [complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS)["choices"][0]["token_ids"] for p in prompts]
    assert_same_tokens(colocated, plain, "non-streaming P/D output")
    streamed = run_workload(pd.proxy_url, name, prompts, MAX_TOKENS, concurrency=4, progress=False)
    assert not [r.error for r in streamed if r.error]
    assert [r.finish_reason for r in streamed] == ["length"] * len(prompts)
    assert_same_tokens(colocated, [r.token_ids for r in streamed], "streaming P/D output")


def test_corrupted_requests_change_output_streaming_and_not(pd, prompts, control_prompts, references) -> None:
    """The negative control of the identity check above, through the same proxy and servers:
    block-boundary prompts whose KV the test hooks corrupt silently complete normally with other
    tokens, streamed and not. Seen to fail: with tamper.corrupt a no-op it reports 'decoded identically'."""
    name, expected = pd.prefill[0].served_model_name, references[len(prompts):]
    plain = [complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS, **CORRUPT)["choices"][0]
             for p in control_prompts]
    assert_control_changed(expected, [c["token_ids"] for c in plain], [c["finish_reason"] for c in plain],
                           CONTROL_LENGTHS, what="corrupted requests through the proxy, not streamed")
    streamed = run_workload(pd.proxy_url, name, control_prompts, MAX_TOKENS, concurrency=4, progress=False,
                            extra_body=CORRUPT)
    assert not [r.error for r in streamed if r.error]
    assert_control_changed(expected, [r.token_ids for r in streamed], [r.finish_reason for r in streamed],
                           CONTROL_LENGTHS, what="corrupted requests through the proxy, streamed")


def _chat(url: str, model: str, stream: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the river and the tier."}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if not stream:
        return post_json(f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]

    async def go() -> str:
        text = ""
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    delta = json.loads(line[5:])["choices"][0].get("delta", {})
                    text += delta.get("content") or ""
        return text
    return asyncio.run(go())


def test_chat_non_streaming_and_streaming(pd) -> None:
    name = pd.prefill[0].served_model_name
    direct = _chat(pd.decode[0].url, name, stream=False)  # decode instance computing alone
    assert direct, "empty chat completion"
    assert _chat(pd.proxy_url, name, stream=False) == direct
    assert _chat(pd.proxy_url, name, stream=True) == direct


def test_client_disconnect_mid_stream_frees_both_instances(pd) -> None:
    name = pd.prefill[0].served_model_name

    async def leave_early() -> int:
        body = {"model": name, "prompt": list(range(30, 130)), "max_tokens": 1500, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        chunks = 0
        async with aiohttp.ClientSession() as s, s.post(f"{pd.proxy_url}/v1/completions", json=body) as r:
            async for _ in r.content:
                chunks += 1
                if chunks >= 5:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    assert asyncio.run(leave_early()) >= 5
    assert wait_until(lambda: idle(pd.decode[0]) and idle(pd.prefill[0])), (
        "the abandoned request is still running on an instance")


def _idle_sockets(host: str, port: int, sources: list[tuple[str, int]]) -> list:
    """Connections to a store server from each (source address, count), each sending a valid Hello
    and then nothing (issue 34's flood); the caller closes them."""
    import socket

    import msgspec

    from kvconnectors.transport import wire

    payload = msgspec.msgpack.encode(wire.Hello(version=wire.PROTOCOL_VERSION, compat_hash=wire.compat_hash("tiered"),
                                                peer="flood", nonce=os.urandom(32)))
    hello = len(payload).to_bytes(4, "big") + payload
    made = []
    for source, n in sources:
        for _ in range(n):
            s = socket.socket()
            made.append(s)
            try:
                s.bind((source, 0))
                s.settimeout(5)
                s.connect((host, port))
                s.sendall(hello)
            except OSError:
                pass  # refused or reset over a cap: as meant
    return made


def test_a_flood_of_idle_sessions_from_the_decodes_own_address_and_others_does_not_fail_pulls(
        pd, prompts, colocated) -> None:
    """Issue 34, row 5, on the live pair: 400 sessions that never send a request from 127.0.0.1 (the
    decode's own address) and 80 from each of 127.0.0.2-6 sit on the prefill's store port (no secret:
    a Hello admits them). Every pull still gets a connection (the idle ones make room: before, the
    decode's own address was over its cap and a pull failed peer_unreachable), and the outputs stay
    identical to colocated."""
    host, port = pd.plans[0].kv_addr.rsplit(":", 1)
    failed_before = dict(failures_by_cause(pd.decode[0]))
    flood = _idle_sockets(host, int(port), [("127.0.0.1", 400)] + [(f"127.0.0.{i}", 80) for i in range(2, 7)])
    try:
        name = pd.prefill[0].served_model_name
        outs = [complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS)["choices"][0]["token_ids"]
                for p in prompts + prompts]
        assert_same_tokens(colocated + colocated, outs, "P/D output under the flood")
        assert dict(failures_by_cause(pd.decode[0])) == failed_before, "a pull failed (recomputed) under the flood"
    finally:
        for s in flood:
            s.close()


def _kill(server: VllmServer) -> None:
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)


def test_decode_killed_gives_clear_errors_not_hangs(pd) -> None:
    """The last test on `pd`: it kills its decode, then stops the pair (the next test starts its own)."""
    cluster = pd
    try:
        name = cluster.prefill[0].served_model_name

        async def run() -> list[str]:
            async def one(i: int) -> str:
                body = {"model": name, "prompt": list(range(40 + i, 140 + i)), "max_tokens": 1500,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}
                async with aiohttp.ClientSession() as s, s.post(f"{cluster.proxy_url}/v1/completions", json=body,
                                                                timeout=aiohttp.ClientTimeout(total=60)) as r:
                    if r.status != 200:
                        return f"http {r.status}"
                    async for raw in r.content:
                        if b'"error"' in raw:
                            return "sse error"
                    return "completed"
            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            await asyncio.sleep(1.5)
            _kill(cluster.decode[0])
            return await asyncio.gather(*tasks)

        start = time.monotonic()
        outcomes = asyncio.run(run())
        assert time.monotonic() - start < 45, "clients were left hanging after the decode instance died"
        assert all(o in ("sse error", "http 502", "http 503") for o in outcomes), outcomes
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:  # a new request: a clear OpenAI-style error, fast
            complete(cluster.proxy_url, [1, 2, 3], model=name, max_tokens=4, timeout=30)
        assert time.monotonic() - t0 < 15
        assert "error" in str(err.value).lower() or "50" in str(err.value)
    finally:
        pd.stop()


def test_prefill_killed_traffic_moves_to_the_other(tiny_model, prompts, colocated, tmp_path) -> None:
    """Two kv_both instances, each in both pools (two engines on two cores)."""
    cfg = {"kv_connector": "TieredConnector", "kv_connector_module_path": "kvconnectors.tiered",
           "kv_role": "kv_both", "kv_connector_extra_config": {"transport": "tcp"}}
    from kvconnectors.integration.launcher import PACKAGE_ROOT, parse_proxy_argv

    servers = [VllmServer(tiny_model, name=f"both-{i}", core=i, pythonpath=[PACKAGE_ROOT],
                          extra_args=["--kv-transfer-config", json.dumps(cfg)], log_path=tmp_path / f"{i}.log")
               for i in range(2)]
    proxy = None
    try:
        for s in servers:
            s.start(wait=False)
        for s in servers:
            s.wait_healthy()
        argv = ["--port", str(free_port()), "--kv-both", *PROXY_FAST]
        for s in servers:
            argv += ["--prefill", s.url, "--decode", s.url]
        proxy = ProxyThread(parse_proxy_argv(argv)).start()
        name = servers[0].served_model_name
        before = run_workload(proxy.url, name, prompts, MAX_TOKENS, concurrency=2, progress=False)
        assert_same_tokens(colocated, [r.token_ids for r in before])
        _kill(servers[1])
        after = run_workload(proxy.url, name, prompts * 2, MAX_TOKENS, concurrency=2, progress=False,
                             timeout_s=60)
        failed = [r for r in after if r.error]
        # Requests caught on the dying instance may fail, cleanly; the rest move to the survivor.
        assert len(failed) <= 2, [r.error for r in failed]
        ok = [r for r in after if not r.error]
        assert_same_tokens([colocated[r.index % len(prompts)] for r in ok], [r.token_ids for r in ok])
        again = run_workload(proxy.url, name, prompts, MAX_TOKENS, concurrency=2, progress=False)
        assert not [r.error for r in again if r.error], "the pool did not recover onto the live instance"
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(servers)
