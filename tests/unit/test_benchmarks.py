"""Smoke tests of the benchmarks (tiny sizes, 1-2 iterations; no speed assertions)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from benchmarks import tiers, transfer  # noqa: E402
from kvconnectors.transport.nixl import nixl_import_error  # noqa: E402

HAVE_NIXL = nixl_import_error() is None
PATH_KEYS = {"kind", "status", "reason", "verified", "times_s", "iterations", "median_s", "p99_s", "gbps_median",
             "gbps_p99", "us_per_token_median", "us_per_token_p99", "vs_memcpy"}


def _png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


@pytest.mark.timeout(120)
def test_transfer_smoke(tmp_path):
    paths = ["memcpy", "gather", "socket", "tcp", "shm"] + (["nixl"] if HAVE_NIXL else [])
    result = transfer.run_transfer(preset="tiny", tokens=64, block_tokens=16, iters=2, paths=paths,
                                   out=str(tmp_path), show_progress=False, quiet=True)
    on_disk = json.loads(open(result["files"]["json"]).read())
    assert on_disk["benchmark"] == "transfer"
    assert {"config", "host", "paths", "comparisons", "files"} <= set(on_disk)
    cfg = on_disk["config"]
    assert (cfg["preset"], cfg["num_layers"], cfg["num_blocks"], cfg["slot_bytes"]) == ("tiny", 2, 4, 8192)
    assert cfg["total_bytes"] == 2 * 4 * 8192 and cfg["checksum"] is True
    assert list(on_disk["paths"]) == paths
    for name, s in on_disk["paths"].items():
        assert s["status"] == "ok", (name, s["reason"])
        assert PATH_KEYS <= set(s), name
        assert s["verified"] is True, name
        assert s["iterations"] == 2 and len(s["times_s"]) == 2
        assert s["gbps_median"] > 0 and s["gbps_p99"] > 0 and s["us_per_token_median"] > 0, name
        assert s["p99_s"] >= s["median_s"] > 0
    assert on_disk["paths"]["memcpy"]["vs_memcpy"] == pytest.approx(1.0)
    pairs = {(c["ours"], c["baseline"]) for c in on_disk["comparisons"]}
    assert {("tcp", "socket"), ("shm", "memcpy")} <= pairs
    for c in on_disk["comparisons"]:
        if c["baseline"] in on_disk["paths"]:
            assert c["ratio"] > 0 and isinstance(c["met"], bool)
    _png(result["files"]["png"])
    text = transfer.render(result)
    assert "tcp / socket" in text and "checksums ON" in text


@pytest.mark.timeout(60)
def test_transfer_no_checksum_and_unknown_path(tmp_path):
    result = transfer.run_transfer(preset="tiny", tokens=32, block_tokens=16, iters=1, paths="memcpy,gather",
                                   out=str(tmp_path), checksum=False, show_progress=False, quiet=True)
    assert result["config"]["checksum"] is False
    assert result["files"]["json"].endswith("_nocsum.json")
    with pytest.raises(ValueError, match="unknown path"):
        transfer.parse_paths("memcpy,warp-drive")


@pytest.mark.timeout(60)
def test_tiers_smoke(tmp_path):
    result = tiers.run_tiers(nbytes=1 << 20, preset="tiny", block_tokens=16, entry_tokens=64, rounds=2, warmup=0,
                             directory=str(tmp_path / "disk"), out=str(tmp_path / "out"), show_progress=False,
                             quiet=True)
    on_disk = json.loads(open(result["files"]["json"]).read())
    assert on_disk["benchmark"] == "tiers"
    assert on_disk["verified"] == {"restore": True, "raw_read": True}
    assert len(on_disk["rounds"]) == 2
    for row in on_disk["rounds"]:
        assert row["spill_bytes"] == row["restore_bytes"] == row["raw_bytes"] == 1 << 20
        assert row["spilled_entries"] == on_disk["config"]["entries_per_phase"]
    s = on_disk["summary"]
    for key in ("spill_gbps", "restore_gbps", "raw_write_gbps", "raw_read_gbps"):
        assert s[key]["median"] > 0, key
    assert {c["ours"] for c in on_disk["comparisons"]} == {"spill", "restore"}
    assert all(c["ratio"] > 0 for c in on_disk["comparisons"])
    _png(result["files"]["png"])
    assert not list((tmp_path / "disk").iterdir()), "the temporary tier files were not removed"


def test_cli_help_exits_zero(capsys):
    from kvconnectors.cli import main

    for argv in (["bench", "transfer", "--help"], ["bench", "tiers", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--no-checksum" in out and "--block-tokens" in out and "--dir" in out


@pytest.mark.timeout(60)
def test_cli_runs_transfer(tmp_path, capsys):
    from kvconnectors.cli import main

    rc = main(["bench", "transfer", "--preset", "tiny", "--tokens", "32", "--iters", "1", "--paths", "memcpy,gather",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert "memcpy" in capsys.readouterr().out
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())


# --------------------------------------------------------------------------------------------
# proxy overhead (fake upstreams: no engine)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_proxy_overhead_fake_upstreams(tmp_path, stream):
    from benchmarks import proxy_overhead

    result = proxy_overhead.run_fake(12, tmp_path, stream=stream, progress=False)
    assert result["upstreams"] == "fake" and result["requests"] == 12 and result["stream"] is stream
    for key in ("by_hand_ms", "via_proxy_ms", "added_ms"):
        assert {"p50", "p99"} <= set(result[key]), key
    assert 0 < result["by_hand_ms"]["p50"] < 1000 and 0 < result["via_proxy_ms"]["p50"] < 1000
    lo, hi = result["added_ms"]["p50_ci95"]
    assert lo <= hi
    assert len(result["pairs_ms"]["by_hand"]) == len(result["pairs_ms"]["via_proxy"]) == 12


@pytest.mark.timeout(60)
def test_proxy_overhead_fakes_refuse_a_request_that_skipped_the_proxy():
    """The fake decode instance answers 400 to a body without the prefill's kv_transfer_params, so
    a proxy that drops them (or a "proxy" URL that is not one) fails the benchmark."""
    import asyncio

    import aiohttp

    from benchmarks import proxy_overhead

    async def by_hand_only(fakes: proxy_overhead.FakeUpstreams) -> float:
        async with aiohttp.ClientSession() as s:
            body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2}
            return await proxy_overhead._direct(s, fakes.prefill_url, fakes.decode_url, body)

    with proxy_overhead.FakeUpstreams() as fakes:
        assert asyncio.run(by_hand_only(fakes)) > 0  # both legs by hand: the fakes accept them
        with pytest.raises(AssertionError):  # the decode URL given as the proxy: no kv_transfer_params
            asyncio.run(proxy_overhead.measure(fakes.decode_url, fakes.prefill_url, fakes.decode_url, "fake", 2,
                                               progress=False))


def test_proxy_overhead_summary_and_interval():
    from benchmarks.proxy_overhead import summarize

    result = summarize([0.010] * 5, [0.0115] * 5)
    assert result["added_ms"]["p50"] == pytest.approx(1.5)
    assert result["added_ms"]["p50_ci95"] == [pytest.approx(1.5), pytest.approx(1.5)]
    assert result["requests"] == 5 and result["pairs_ms"]["via_proxy"] == [11.5] * 5


def test_proxy_overhead_cli_help(capsys):
    from kvconnectors.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "proxy", "--help"])
    assert exc.value.code == 0
    assert "--fake-upstreams" in capsys.readouterr().out
