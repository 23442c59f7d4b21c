"""The README's main job, run as a user runs it (`kvconnectors demo`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_demo_matches_colocated(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "kvconnectors.cli", "demo", "--requests", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_to_colocated"] == 8 and summary["wrong_outputs"] == 0, summary
    assert summary["kv_bytes_moved"] > 0 and summary["failed_requests"] == 0, summary
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode output == colocated : 8/8 requests  OK" in proc.stdout
