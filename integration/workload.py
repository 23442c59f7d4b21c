"""A bounded streaming workload against an OpenAI completions endpoint, with per-token timing.

Each request streams (SSE) so time to first token and every inter-token gap are measured as
a client sees them; greedy token ids are collected for the correctness check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm


@dataclass
class RequestResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)   # inter-token latencies
    token_times: list[float] = field(default_factory=list)  # absolute, for gap-over-time plots
    latency_s: float = 0.0
    error: str | None = None
    finish_reason: str | None = None  # "length" when all went well (greedy, ignore_eos, max_tokens)


async def _one(session: aiohttp.ClientSession, url: str, model: str, index: int, prompt: Sequence[int] | str,
               max_tokens: int, timeout_s: float, extra_body: dict | None = None) -> RequestResult:
    res = RequestResult(index)
    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True, **(extra_body or {})}
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    break
                now = time.perf_counter()
                choice = chunk["choices"][0]
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
                ids = choice.get("token_ids") or []
                for _ in ids:
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.gaps_s.append(now - last)
                    res.token_times.append(now)
                    last = now
                res.token_ids.extend(ids)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency_s = time.perf_counter() - start
    return res


async def run_workload_async(url: str, model: str, prompts: Sequence[Sequence[int] | str], max_tokens: int,
                             concurrency: int = 4, timeout_s: float = 300.0, progress: bool = True,
                             desc: str = "requests", extra_body: dict | None = None) -> list[RequestResult]:
    """Stream every prompt (at most `concurrency` at once); `extra_body` goes into every request body."""
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress)

    async with aiohttp.ClientSession() as session:
        async def guarded(i: int, p: Sequence[int] | str) -> RequestResult:
            async with sem:
                r = await _one(session, url, model, i, p, max_tokens, timeout_s, extra_body)
            bar.update(1)
            return r

        results = await asyncio.gather(*(guarded(i, p) for i, p in enumerate(prompts)))
    bar.close()
    return list(results)


def run_workload(url: str, model: str, prompts: Sequence[Sequence[int] | str], max_tokens: int,
                 **kwargs: object) -> list[RequestResult]:
    return asyncio.run(run_workload_async(url, model, prompts, max_tokens, **kwargs))  # type: ignore[arg-type]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    if not values:
        return {f"p{int(q)}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{int(q)}": float(np.percentile(arr, q)) for q in qs}
