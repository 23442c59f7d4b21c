"""Unit-test fixtures."""

from __future__ import annotations

import logging

import pytest

from kvconnectors import logs


@pytest.fixture(autouse=True)
def plain_kvconnectors_logging():
    """Unit tests read kvconnectors records with caplog, on the root logger. An engine test earlier in
    this process may have routed them through vLLM's logger (logs.use_vllm_logging, run when vLLM loads
    the plugin or imports the connector): lifted for each unit test, put back after it."""
    root = logging.getLogger(logs.ROOT)
    bridges = [h for h in root.handlers if isinstance(h, logs.ToVllm)]
    if not bridges:
        yield
        return
    level, propagate = root.level, root.propagate
    for handler in bridges:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)
    root.propagate = True
    try:
        yield
    finally:
        for handler in bridges:
            root.addHandler(handler)
        root.setLevel(level)
        root.propagate = propagate


@pytest.fixture(autouse=True)
def cpu_host_for_serve_pd(monkeypatch):
    """`serve-pd --device auto` (the default) asks the host for CUDA devices. Unit tests plan for a
    CPU host wherever they run, a GPU host included; test_launcher_gpu.py fakes a CUDA host itself."""
    from kvconnectors.integration import launcher

    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 0)
