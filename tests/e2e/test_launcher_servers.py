"""`kvconnectors serve-pd` as a user runs it: real servers, the proxy, a request, Ctrl-C, nothing left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import psutil
import pytest

from kvconnectors.serving import complete, free_port
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def _ours(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if tag in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"serve-pd exited early with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"proxy at {url} not healthy after {timeout} s")


PROMPTS = token_prompts([40, 100, 170], seed=3)
CONTROLS = token_prompts(control_lengths(32), seed=4)


@pytest.fixture(scope="module")
def colocated(tiny_model) -> list[list[int]]:
    """One reference engine for both connectors."""
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, PROMPTS + CONTROLS, 8)


@pytest.mark.parametrize("connector", ["TieredConnector", "NixlConnector"])
def test_serve_pd_serves_and_shuts_down_cleanly(tiny_model, colocated, connector, tmp_path) -> None:
    """Identity through serve-pd; for TieredConnector also its negative control on the same pool
    (test hooks on, the proxy passing kvc_fault on): corrupted block-boundary prompts change.
    NixlConnector has no corruption hook (see the conformance suite)."""
    prompts, controls = PROMPTS, CONTROLS
    tag = f"kvc-launch-{uuid.uuid4().hex[:8]}"
    port = free_port()
    hooks = connector == "TieredConnector"
    extra = ["--kv-transfer-config-extra", '{"kv_connector_extra_config": {"test_hooks": true}}',
             "--proxy-args=--forward-kv-params kvc_fault --unlock-transfer-keys"] if hooks else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconnectors.cli", "serve-pd", "--model", tiny_model, "--prefill", "1",
         "--decode", "1", "--connector", connector, "--proxy-port", str(port), "--served-model-name", tag,
         "--log-dir", str(tmp_path), "--quiet", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        assert len([p for p in _ours(tag) if "api_server" in " ".join(p.cmdline())]) >= 2
        outs = [complete(url, p, model=tag, max_tokens=8)["choices"][0]["token_ids"] for p in prompts]
        assert_same_tokens(colocated[:len(prompts)], outs, f"{connector} P/D output via serve-pd")
        if hooks:
            bad = [complete(url, p, model=tag, max_tokens=8, kv_transfer_params={"kvc_fault": "corrupt"})["choices"][0]
                   for p in controls]
            assert_control_changed(colocated[len(prompts):], [c["token_ids"] for c in bad],
                                   [c["finish_reason"] for c in bad], control_lengths(32),
                                   what="corrupted requests via serve-pd")
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rc = proc.wait(timeout=90)
        assert rc in (0, 130), rc
        deadline = time.monotonic() + 30
        while _ours(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ours(tag), f"left running after Ctrl-C: {[p.pid for p in _ours(tag)]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _ours(tag):
            p.kill()
