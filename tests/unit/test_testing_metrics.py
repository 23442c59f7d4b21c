"""The /metrics readers the end-to-end tests share (kvconnectors/testing/metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kvconnectors.testing.metrics import by_label, failures_by_cause, total

SAMPLES = {
    "kvconnectors:transfer_failures_total": [({"cause": "timeout", "engine": "0"}, 2.0),
                                             ({"cause": "auth", "engine": "0"}, 1.0),
                                             ({"cause": "timeout", "engine": "1"}, 1.0)],
    "kvconnectors:transfer_bytes_total": [({"path": "tcp"}, 10.0), ({"path": "shm"}, 0.0), ({"path": "tcp"}, 5.0)],
}


def test_total_sums_the_samples_whose_labels_match() -> None:
    assert total(SAMPLES, "kvconnectors:transfer_failures_total") == 4.0
    assert total(SAMPLES, "kvconnectors:transfer_failures_total", cause="timeout") == 3.0
    assert total(SAMPLES, "kvconnectors:transfer_failures_total", cause="timeout", engine="1") == 1.0
    assert total(SAMPLES, "kvconnectors:transfer_failures_total", cause="store_full") == 0.0
    assert total(SAMPLES, "kvconnectors:no_such_metric") == 0.0


def test_by_label_sums_per_value_and_leaves_zeros_out() -> None:
    assert by_label(SAMPLES, "kvconnectors:transfer_bytes_total", "path") == {"tcp": 15.0}
    assert by_label(SAMPLES, "kvconnectors:transfer_failures_total", "cause") == {"timeout": 3.0, "auth": 1.0}


def test_failures_by_cause_reads_a_servers_metrics() -> None:
    server = SimpleNamespace(metrics=lambda: SAMPLES)
    assert failures_by_cause(server) == {"timeout": 3.0, "auth": 1.0}
