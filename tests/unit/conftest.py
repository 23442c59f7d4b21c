"""Unit-test fixtures."""

from __future__ import annotations

import pytest

from kvconnectors.testing.logcapture import plain_logging


@pytest.fixture(autouse=True)
def plain_kvconnectors_logging():
    """Unit tests read kvconnectors records with caplog, on the root logger (testing/logcapture.py)."""
    with plain_logging():
        yield


@pytest.fixture(autouse=True)
def cpu_host_for_serve_pd(monkeypatch):
    """`serve-pd --device auto` (the default) asks the host for CUDA devices. Unit tests plan for a
    CPU host wherever they run, a GPU host included; test_launcher_gpu.py fakes a CUDA host itself."""
    from kvconnectors.integration import launcher

    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 0)
