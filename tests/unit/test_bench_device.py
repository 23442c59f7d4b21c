"""`kvconnectors bench device` on CPU (--quick): runs the real Stager/Loader, verifies the bytes, imports no
vLLM, and fails (exit 1) when a staged byte is flipped (--corrupt, the negative control)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import kvconnectors.benchmarks.device as device
from kvconnectors.cli import main
torch_at_import = "torch" in sys.modules  # `kvconnectors bench --help` imports every bench module: keep it light
rc = main(["bench", "device", "--device", "cpu", "--quick", "--layout", "LBHNC,BHLNC", "--no-progress",
           "--out", sys.argv[1], "--results-dir", sys.argv[2]])
import torch
rc_cuda = None if torch.cuda.is_available() else main(["bench", "device", "--device", "cuda", "--quick",
                                                       "--no-progress", "--out", sys.argv[1]])
print("DEVICE_BENCH " + json.dumps({"rc": rc, "rc_cuda": rc_cuda, "vllm": sorted(m for m in sys.modules
       if m == "vllm" or m.startswith("vllm.")), "torch_at_import": torch_at_import}))
sys.exit(rc)
"""


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(180)
def test_quick_cpu_run_is_verified_and_vllm_free(tmp_path):
    p = _run(["-c", SCRIPT, str(tmp_path / "out"), str(tmp_path / "res")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tag = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("DEVICE_BENCH ")).split(" ", 1)[1])
    assert tag["rc"] == 0 and tag["vllm"] == [] and tag["torch_at_import"] is False, tag
    assert tag["rc_cuda"] in (None, 2)  # no CUDA here: a clear refusal, not a traceback
    out = p.stdout
    assert "CUDA paths: NOT yet validated on a GPU" in out
    assert "verified LBHNC: 2.0 MiB byte-exact" in out and "verified BHLNC: 2.0 MiB byte-exact" in out
    assert "VERIFY FAILED" not in out + p.stderr
    result = json.loads((tmp_path / "out" / "device_cpu_LBHNC_BHLNC_8b.json").read_text())
    assert result["benchmark"] == "device" and result["verified"] is True and result["problems"] == []
    cfg = result["config"]
    assert (cfg["device"], cfg["num_layers"], cfg["blocks"], cfg["quick"]) == ("cpu", 4, 8, True)
    assert cfg["model"]["kv_heads"] == 8 and cfg["model"]["content"] == 256 and cfg["model"]["block_size"] == 16
    for name in ("LBHNC", "BHLNC"):
        x = result["layouts"][name]
        assert x["geometry"]["block_bytes"] == 8 * 16 * 256 * 2 and x["bytes_per_transfer"] == 4 * 8 * 65536
        assert x["verified"]["ok"] and x["verified"]["checksummed_rows"] == 32
        for path in ("stage", "stage_raw", "gather", "load", "scatter"):
            s = x["paths"][path]
            assert s["iterations"] == 2 and s["gbps_median"] > 0, (name, path)
        assert x["ratios"]["stage_vs_gather"] > 0 and x["ratios"]["load_vs_scatter"] > 0
        assert x["cuda"] == {}
    # the CUDA lines render (no GPU here: a made-up CUDA section on this run's result)
    from kvconnectors.benchmarks import device

    x = result["layouts"]["LBHNC"]
    x["cuda"] = {"peak": {"d2h_gbps": 50.0, "h2d_gbps": 55.0}, "stage_vs_d2h_peak": 0.8, "gather_vs_d2h_peak": 0.9,
                 "load_vs_h2d_peak": 0.85, "scatter_vs_h2d_peak": None,
                 "forward": {"matmuls_per_loop": 40, "matmul": "4096x4096 bf16", "alone_s": 0.01,
                             "with_staging_s": 0.0105, "slowdown": 1.05, "staging_inside_loop": True}}
    text = device.render(result)
    assert "d2h 50.00 GB/s (stage 0.80, gather 0.90), h2d 55.00 GB/s (load 0.85, scatter -)" in text
    assert "slowdown 1.050x (staging done inside the loop: yes)" in text
    body = (tmp_path / "res" / "device_cpu_LBHNC_BHLNC_8b.txt").read_text().split("\n", 1)[1]  # after the command
    assert body.startswith("kvconnectors bench device: cpu") and body.rstrip("\n") in out


@pytest.mark.timeout(180)
def test_a_flipped_staged_byte_fails_the_run(tmp_path):
    p = _run(["-m", "kvconnectors.benchmarks.device", "--device", "cpu", "--quick", "--corrupt", "--no-progress",
              "--out", str(tmp_path)])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "VERIFY FAILED" in p.stderr and "moved blocks differ from the source" in p.stderr
    assert "do not match the checksum Stager.complete returned" in p.stderr
    assert "--corrupt: flipped byte 17 of layer 2" in p.stdout


def test_help_lists_the_flags(capsys):
    from kvconnectors.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "device", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--device", "--quick", "--layout", "--blocks", "--corrupt", "--results-dir"):
        assert flag in text, flag
