"""Two real vLLM OpenAI servers alive at once, each pinned to its own core: both answer a greedy
completion with the same token ids, and teardown leaves no process behind."""

from __future__ import annotations

import os

import psutil
import pytest

from kvconnectors.serving import VllmServer, process_tree, stop_all, tree_affinities
from kvconnectors.testing.prompts import token_prompts


def _leftovers(pids: list[int], pgids: list[int]) -> list[str]:
    """Live (non-zombie) processes among `pids` or in any of the process groups `pgids`."""
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.pid in pids or os.getpgid(p.pid) in pgids:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_two_pinned_servers_agree_and_leave_nothing(tiny_model, tmp_path):
    # The machine's cores, not this process's affinity: in-process engines earlier in the session
    # pin the test process to one core, which silently skipped this test.
    cores = list(range(os.cpu_count() or 1))
    if len(cores) < 2:
        pytest.skip("needs two cores to pin two servers apart")
    prompt = token_prompts([100], seed=3)[0]
    servers = [
        VllmServer(tiny_model, name=f"srv-{i}", served_model_name="tiny", core=cores[i],
                   log_path=tmp_path / f"srv-{i}.log", health_timeout=240)
        for i in range(2)
    ]
    tree_pids: list[int] = []
    try:
        for s in servers:  # launch both, then wait: the two starts overlap
            s.start(wait=False)
        for s in servers:
            s.wait_healthy()
        outs = [s.greedy_token_ids(prompt, max_tokens=16, timeout=120) for s in servers]
        for s in servers:  # no repin() here: threads spawned by the request must be pinned already
            tree_pids += [p.pid for p in process_tree(s.pid)]
            affinity = tree_affinities(s.pid)
            assert len(affinity) > 4, affinity
            stray = {tid: cpus for tid, cpus in affinity.items() if cpus != {s.core}}
            assert not stray, f"{s.name}: threads not pinned to core {s.core}: {stray}"
        assert len(outs[0]) == 16
        assert outs[0] == outs[1], outs
    finally:
        stop_all(servers, timeout=60)
    assert all(not s.is_running() for s in servers)
    left = _leftovers(tree_pids, [s.pid for s in servers])
    assert not left, f"processes left after stop(): {left}"
