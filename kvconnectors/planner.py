"""Should I split prefill and decode, and how many GPUs per pool? An analytic answer.

Pure Python (no vLLM, no torch): a handful of closed-form costs from the seed articles
(`/work/shared/seeds/`), combined into a `Plan` whose `verdict` is a sentence a person can act on.

The model
---------
- **Prefill is compute-bound**: 2 x params FLOPs per prompt token, at a given MFU of the GPU's dense
  peak. Attention's quadratic term is ignored, as in the seed (its 8,000-token prefill costs exactly
  4x its 2,000-token one).
- **Decode is memory-bandwidth-bound**: one step reads the weights once plus the KV cache of every
  live user (users x context tokens x KV bytes per token).
- **KV bytes per token** = layers x 2 (K and V) x KV heads x head dim x dtype bytes.
- **The transfer** moves a prompt's KV at the link's nominal line rate in one direction (no protocol
  overhead: that is what makes the seed's per-token figures come out).
- **Worst decode gap** (the freeze decoding users see when one prompt arrives): colocated, the step
  that carries the whole prefill (prefill + one decode step); chunked, one chunk's prefill + one
  decode step; disaggregated, one plain decode step (the decode GPU never prefills).
- **TTFT** on an idle system: colocated = prefill; chunked = prefill + one decode step per chunk (each
  chunk rides along a decode step); disaggregated bulk = prefill + transfer; disaggregated layer-wise
  = a two-stage pipeline (compute a layer group, ship it) = max(prefill + one group's transfer,
  transfer + one group's prefill). When the link keeps up this is prefill + one group's transfer
  (ARCHITECTURE.md, "Push mode"); when it does not, the link runs back to back after the first group.
- **The decision rule** (seed 000, "Why it breaks"): split when the TTFT the transfer adds is smaller
  than the decode stall it removes (colocated worst gap - disaggregated worst gap = the prefill).
  Both grow linearly with the prompt, so the answer does not depend on prompt length.
- **Pool sizes** by Little's law: GPUs = arrival rate x service time / target utilisation. Prefill's
  service time is one prompt's prefill. Decode's is output tokens x decode step.

How the seed's figures come out (8B model, H100 SXM, 40% MFU; tests/unit/test_planner.py checks them)
------------------------------------------------------------------------------------------------------
- **Parameter count.** "8B-class" with "16 GB of weights" means 8.0e9 params at 2 bytes. That gives
  80.9 / 323.6 ms for 2,000 / 8,000-token prefills (seed: ~81 / ~323). Llama-3-8B's real 8.03e9
  would give 324.8 ms and a 332 ms worst gap instead of the seed's 323 and 330.
- **"~4.9 ms bare" decode step.** A weights-only read is 16 GB / 3.35 TB/s = 4.78 ms, which rounds
  to 4.8, not 4.9. No single weight size matches both 4.9 ms bare and 7.3 ms with 32 x 2,000 tokens
  of KV. A batch of *one* 2,000-token sequence gives 4.85 ms, i.e. ~4.9, and so does every other
  seed figure under the same assumptions. We read the seed's "bare" step as one user, not zero.
- **128 KB per token is 128 KiB** (131,072 bytes = 32 x 2 x 8 x 128 x 2). The per-token link times
  (0.29 / 5.2 / 10.5 / 41.9 us) only come out with KiB. The seed's "256 MB for 2,000 tokens" is
  2,000 x 128 KiB written loosely (262 MB).
- **NVLink at 450 GB/s**: one direction of H100's 900 GB/s NVLink 4. Ethernet and InfiniBand run
  at their line rate (Gb/s / 8).
- **Decode pool of ~36 GPUs.** The seed divides 20 req/s x 200 tokens x 7.28 ms (the step time
  *with 32 users batched*) by 0.8 utilisation, so it counts each decode GPU as serving one stream
  at a time. A GPU that batches those 32 streams needs 32x fewer GPUs. `Pools` reports both:
  `decode_gpus_one_stream` (the seed's count) and `decode_gpus_batched`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from kvconnectors.errors import ConfigError

# ---------------------------------------------------------------------------------------------------
# validation helpers: every check names the key and the value (ConfigError's message does both)


def _check(key: str, value: object, ok: bool, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(key: str, value: float) -> None:
    _check(key, value, _is_number(value) and value > 0, "must be a finite number > 0")


def _count(key: str, value: int) -> None:
    _check(key, value, isinstance(value, int) and not isinstance(value, bool) and value >= 1,
           "must be a whole number >= 1")


def _fraction(key: str, value: float) -> None:
    _check(key, value, _is_number(value) and 0 < value <= 1, "must be a fraction in (0, 1]")


# ---------------------------------------------------------------------------------------------------
# specs


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as prefill/decode costs care."""

    name: str
    params: float      # parameter count
    layers: int
    kv_heads: int      # KV heads (GQA groups), not query heads
    head_dim: int
    dtype_bytes: int   # bytes per weight and per KV element: 4 fp32, 2 bf16, 1 fp8

    def __post_init__(self) -> None:
        _positive("params", self.params)
        for key in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            _count(key, getattr(self, key))

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes  # 2 = K and V

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_bytes_per_token_layer

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator (or one tensor-parallel group, if you pass the group's totals)."""

    name: str
    peak_tflops: float   # dense bf16/fp16 tensor throughput, TFLOP/s (no sparsity)
    mem_bw_tbs: float    # HBM/GDDR bandwidth, TB/s (1e12 bytes/s)
    memory_gb: float     # device memory, GB (1e9 bytes)

    def __post_init__(self) -> None:
        for key in ("peak_tflops", "mem_bw_tbs", "memory_gb"):
            _positive(key, getattr(self, key))

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def mem_bw(self) -> float:
        return self.mem_bw_tbs * 1e12


@dataclass(frozen=True)
class LinkSpec:
    """The path the KV cache takes from the prefill GPU to the decode GPU, one direction."""

    name: str
    gbps: float   # effective rate, Gbit/s (1e9 bits/s)

    def __post_init__(self) -> None:
        _positive("link_gbps", self.gbps)

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass(frozen=True)
class Workload:
    """Traffic and serving knobs. The defaults are the seed's example (see the module docstring)."""

    prompt_tokens: int = 2000
    output_tokens: int = 200
    users: int = 32              # decode streams batched on one decode GPU
    context_tokens: int = 2000   # live context per decoding user (KV the decode step reads)
    chunk_tokens: int = 128      # chunked-prefill chunk (vLLM --max-num-batched-tokens)
    arrival_rate: float = 20.0   # requests/s
    utilization: float = 0.8     # target utilisation of each pool
    mfu: float = 0.4             # fraction of peak FLOP/s prefill achieves
    layer_group_size: int = 1    # layers shipped together in layer-wise transfer

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "output_tokens", "users", "context_tokens", "chunk_tokens",
                    "layer_group_size"):
            _count(key, getattr(self, key))
        _positive("arrival_rate", self.arrival_rate)
        _fraction("utilization", self.utilization)
        _fraction("mfu", self.mfu)


# ---------------------------------------------------------------------------------------------------
# presets (public spec sheets; links at the rates that reproduce the seed's per-token times)

MODELS: dict[str, ModelSpec] = {
    # "8B-class ... 16 GB of weights": 8.0e9 params (see the module docstring for why not 8.03e9)
    "llama-8b": ModelSpec("llama-8b", params=8.0e9, layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    "llama-70b": ModelSpec("llama-70b", params=70.6e9, layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
    # kvconnectors.testing's tiny Llama: hidden 128, 4 heads, vocab 774, 494k params, fp32
    "tiny": ModelSpec("tiny", params=4.94e5, layers=2, kv_heads=2, head_dim=32, dtype_bytes=4),
}

GPUS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec("h100-sxm", peak_tflops=989, mem_bw_tbs=3.35, memory_gb=80),
    "h200": GPUSpec("h200", peak_tflops=989, mem_bw_tbs=4.8, memory_gb=141),
    "a100-80g": GPUSpec("a100-80g", peak_tflops=312, mem_bw_tbs=2.039, memory_gb=80),
    "l40s": GPUSpec("l40s", peak_tflops=362, mem_bw_tbs=0.864, memory_gb=48),
}

LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("nvlink", gbps=3600),   # NVLink 4: 900 GB/s bidirectional = 450 GB/s each way
    "ib200": LinkSpec("ib200", gbps=200),      # InfiniBand HDR 200 Gb/s
    "100gbe": LinkSpec("100gbe", gbps=100),
    "25gbe": LinkSpec("25gbe", gbps=25),
}


# ---------------------------------------------------------------------------------------------------
# closed-form costs (seconds)


def prefill_s_per_token(model: ModelSpec, gpu: GPUSpec, mfu: float) -> float:
    return 2 * model.params / (gpu.flops * mfu)


def prefill_s(model: ModelSpec, gpu: GPUSpec, mfu: float, tokens: int) -> float:
    return tokens * prefill_s_per_token(model, gpu, mfu)


def decode_step_s(model: ModelSpec, gpu: GPUSpec, users: int, context_tokens: int) -> float:
    """One decode step: read the weights once plus every live user's KV. users=0 is weights only."""
    live_kv = users * context_tokens * model.kv_bytes_per_token
    return (model.weight_bytes + live_kv) / gpu.mem_bw


def transfer_s_per_token(model: ModelSpec, link: LinkSpec) -> float:
    return model.kv_bytes_per_token / link.bytes_per_s


def transfer_s(model: ModelSpec, link: LinkSpec, tokens: int) -> float:
    return tokens * transfer_s_per_token(model, link)


def _step(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    return decode_step_s(model, gpu, w.users, w.context_tokens)


def worst_gap_colocated_s(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    # the iteration that carries the whole prompt also does everyone's decode step
    return prefill_s(model, gpu, w.mfu, w.prompt_tokens) + _step(model, gpu, w)


def worst_gap_chunked_s(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    chunk = min(w.chunk_tokens, w.prompt_tokens)
    return prefill_s(model, gpu, w.mfu, chunk) + _step(model, gpu, w)


def worst_gap_disaggregated_s(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    return _step(model, gpu, w)  # the decode GPU never prefills


def ttft_colocated_s(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    return prefill_s(model, gpu, w.mfu, w.prompt_tokens)


def ttft_chunked_s(model: ModelSpec, gpu: GPUSpec, w: Workload) -> float:
    # every chunk shares its iteration with a decode step, so chunking stretches TTFT
    chunks = math.ceil(w.prompt_tokens / w.chunk_tokens)
    return prefill_s(model, gpu, w.mfu, w.prompt_tokens) + chunks * _step(model, gpu, w)


def ttft_bulk_s(model: ModelSpec, gpu: GPUSpec, link: LinkSpec, w: Workload) -> float:
    return prefill_s(model, gpu, w.mfu, w.prompt_tokens) + transfer_s(model, link, w.prompt_tokens)


def ttft_layerwise_s(model: ModelSpec, gpu: GPUSpec, link: LinkSpec, w: Workload) -> float:
    """Two-stage pipeline over layer groups: the slower stage runs back to back, the faster one
    adds one group's worth (prefill + one group's transfer when the link keeps up)."""
    _check_group(model, w)
    return pipelined_s(prefill_s(model, gpu, w.mfu, w.prompt_tokens), transfer_s(model, link, w.prompt_tokens),
                       w.layer_group_size / model.layers)


def pipelined_s(prefill: float, transfer: float, one_group: float) -> float:
    """Prefill and transfer pipelined over layer groups (`one_group`: a group's share of the
    layers): the slower stage back to back plus one group of the faster one."""
    return max(prefill + transfer * one_group, transfer + prefill * one_group)


def _check_group(model: ModelSpec, w: Workload) -> None:
    _check("layer_group_size", w.layer_group_size, w.layer_group_size <= model.layers,
           f"must be <= the model's {model.layers} layers")


def little_gpus(arrival_rate: float, service_s: float, utilization: float) -> float:
    """Little's law: busy servers = arrival rate x service time; divide by the target utilisation."""
    return arrival_rate * service_s / utilization


# ---------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Pools:
    prefill_gpus: float
    decode_gpus_one_stream: float   # the seed's count: each decode GPU serves one stream at a time
    decode_gpus_batched: float      # each decode GPU batches `users` streams per step


@dataclass(frozen=True)
class LinkAssessment:
    link: LinkSpec
    transfer_per_token_s: float
    transfer_prompt_s: float
    ttft_bulk_s: float
    ttft_layerwise_s: float
    bulk_tax_s: float        # TTFT added over colocated, transfer after prefill
    layerwise_tax_s: float   # TTFT added over colocated, transfer overlapping prefill
    split_bulk: bool
    split_layerwise: bool


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    gpu: GPUSpec
    workload: Workload
    kv_bytes_per_token: int
    weight_bytes: float
    prefill_per_token_s: float
    prefill_s: float
    decode_step_weights_only_s: float
    decode_step_s: float
    worst_gap_colocated_s: float
    worst_gap_chunked_s: float
    worst_gap_disaggregated_s: float
    stall_removed_s: float          # what splitting saves every decoding user, per arriving prompt
    ttft_colocated_s: float
    ttft_chunked_s: float
    decode_memory_gb: float         # weights + the batch's live KV on one decode GPU
    pools: Pools
    chosen: LinkAssessment
    links: tuple[LinkAssessment, ...]
    verdict: str = field(default="")

    def to_dict(self) -> dict:
        return asdict(self)


def assess_link(model: ModelSpec, gpu: GPUSpec, link: LinkSpec, w: Workload) -> LinkAssessment:
    colocated = ttft_colocated_s(model, gpu, w)
    stall = worst_gap_colocated_s(model, gpu, w) - worst_gap_disaggregated_s(model, gpu, w)
    bulk = ttft_bulk_s(model, gpu, link, w)
    layerwise = ttft_layerwise_s(model, gpu, link, w)
    return LinkAssessment(
        link=link,
        transfer_per_token_s=transfer_s_per_token(model, link),
        transfer_prompt_s=transfer_s(model, link, w.prompt_tokens),
        ttft_bulk_s=bulk,
        ttft_layerwise_s=layerwise,
        bulk_tax_s=bulk - colocated,
        layerwise_tax_s=layerwise - colocated,
        split_bulk=bulk - colocated < stall,
        split_layerwise=layerwise - colocated < stall,
    )


def size_pools(model: ModelSpec, gpu: GPUSpec, w: Workload) -> Pools:
    prefill = little_gpus(w.arrival_rate, prefill_s(model, gpu, w.mfu, w.prompt_tokens), w.utilization)
    one_stream = little_gpus(w.arrival_rate, w.output_tokens * _step(model, gpu, w), w.utilization)
    return Pools(prefill_gpus=prefill, decode_gpus_one_stream=one_stream,
                 decode_gpus_batched=one_stream / w.users)


def plan(model: ModelSpec, gpu: GPUSpec, link: LinkSpec, workload: Workload | None = None,
         compare: tuple[LinkSpec, ...] | None = None) -> Plan:
    """Everything the planner knows for one setup; `compare` adds other links to the table."""
    w = workload or Workload()
    _check_group(model, w)
    others = compare if compare is not None else tuple(LINKS.values())
    links = tuple(dict.fromkeys((*others, link)))  # keep order, no duplicates
    result = Plan(
        model=model,
        gpu=gpu,
        workload=w,
        kv_bytes_per_token=model.kv_bytes_per_token,
        weight_bytes=model.weight_bytes,
        prefill_per_token_s=prefill_s_per_token(model, gpu, w.mfu),
        prefill_s=prefill_s(model, gpu, w.mfu, w.prompt_tokens),
        decode_step_weights_only_s=decode_step_s(model, gpu, 0, 0),
        decode_step_s=_step(model, gpu, w),
        worst_gap_colocated_s=worst_gap_colocated_s(model, gpu, w),
        worst_gap_chunked_s=worst_gap_chunked_s(model, gpu, w),
        worst_gap_disaggregated_s=worst_gap_disaggregated_s(model, gpu, w),
        stall_removed_s=worst_gap_colocated_s(model, gpu, w) - worst_gap_disaggregated_s(model, gpu, w),
        ttft_colocated_s=ttft_colocated_s(model, gpu, w),
        ttft_chunked_s=ttft_chunked_s(model, gpu, w),
        decode_memory_gb=(model.weight_bytes
                          + w.users * w.context_tokens * model.kv_bytes_per_token) / 1e9,
        pools=size_pools(model, gpu, w),
        chosen=assess_link(model, gpu, link, w),
        links=tuple(assess_link(model, gpu, other, w) for other in links),
    )
    return _with_verdict(result)


# ---------------------------------------------------------------------------------------------------
# the verdict, in words


def fmt_time(seconds: float) -> str:
    """3 significant figures in the unit that keeps the number readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def verdict_text(p: Plan) -> str:
    return " ".join(s for s in (_bulk_sentence(p), _layerwise_sentence(p), _pools_sentence(p),
                                _memory_sentence(p)) if s)


def _with_verdict(p: Plan) -> Plan:
    return replace(p, verdict=verdict_text(p))


def _share(part: float, whole: float) -> str:
    ratio = part / whole
    return "<1%" if ratio < 0.01 else f"{ratio:.0%}"


def _bulk_sentence(p: Plan) -> str:
    a, w = p.chosen, p.workload
    stall = fmt_time(p.stall_removed_s)
    if a.split_bulk:
        return (f"split: on {a.link.name} the KV transfer adds {fmt_time(a.bulk_tax_s)} to TTFT, "
                f"{_share(a.bulk_tax_s, p.stall_removed_s)} of the {stall} decode freeze it removes "
                f"(worst decode gap {fmt_time(p.worst_gap_colocated_s)} -> "
                f"{fmt_time(p.worst_gap_disaggregated_s)}).")
    return (f"don't split: on {a.link.name} moving the KV of one {w.prompt_tokens}-token prompt takes "
            f"{fmt_time(a.transfer_prompt_s)}, more than the {stall} decode freeze it would remove; "
            f"keep one pool and use chunked prefill (--max-num-batched-tokens {w.chunk_tokens}: "
            f"worst decode gap {fmt_time(p.worst_gap_chunked_s)}, TTFT {fmt_time(p.ttft_chunked_s)}).")


def _layerwise_sentence(p: Plan) -> str:
    a, w = p.chosen, p.workload
    how = (f"layer-wise transfer (groups of {w.layer_group_size} of {p.model.layers} layers, "
           f"overlapping the prefill)")
    tax = f"{fmt_time(a.layerwise_tax_s)} ({_share(a.layerwise_tax_s, p.stall_removed_s)} of the freeze)"
    if a.split_layerwise and not a.split_bulk:
        return (f"With {how} the split adds only {tax} to TTFT: split if you use it "
                f"(TieredConnector push mode).")
    if a.split_layerwise:
        return f"With {how} the split adds only {tax} to TTFT."
    return f"Even with {how} the split adds {tax} to TTFT: still don't split."


def _pools_sentence(p: Plan) -> str:
    if not (p.chosen.split_bulk or p.chosen.split_layerwise):
        return ""
    w, pools = p.workload, p.pools
    return (f"Pools at {w.arrival_rate:g} req/s and {w.utilization:.0%} utilisation: "
            f"{pools.prefill_gpus:.2g} prefill GPUs, {pools.decode_gpus_batched:.2g} decode GPUs "
            f"batching {w.users} streams each ({pools.decode_gpus_one_stream:.3g} if each decode GPU "
            f"served one stream at a time, as the seed article counts).")


def _memory_sentence(p: Plan) -> str:
    if p.decode_memory_gb <= p.gpu.memory_gb:
        return ""
    return (f"Note: a decode GPU needs {p.decode_memory_gb:.0f} GB (weights + {p.workload.users} users' KV) "
            f"but one {p.gpu.name} has {p.gpu.memory_gb:g} GB: use tensor parallelism and pass the group's "
            f"totals (--peak-tflops, --mem-bw-tbs, --memory-gb), or fewer --users.")
