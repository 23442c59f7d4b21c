"""vLLM's CPU attention writer against kvconnectors' per-head byte ranges (issue #20).

TieredConnector re-slices CPU_ATTN blocks by KV head (`mover.reslice.head_runs` over
`geometry_row_layout`), assuming vLLM's CPU kernels pack a block's interior per (kernel block,
head) and never across heads. Nothing but a docstring said so; this module checks it against
vLLM's real writer, per dtype and per ISA packing the backend can pick:

* the cache is allocated by vLLM itself (`vllm.v1.worker.utils.allocate_kv_cache`, a
  `FullAttentionSpec` in KVCacheLayout.LBHNC, the only layout CPU_ATTN supports: per layer
  [blocks, kv_heads, block_size, 2 * head_size]), two layers, optionally with kernel blocks
  smaller than the manager block;
* tokens are written by the backend's own `CPUAttentionBackendImpl.do_kv_cache_update`, which
  views a block as [kv_heads, 2 * block_size, head_size] (K half, then V half) and calls
  `torch.ops._C.cpu_attn_reshape_and_cache` with the layer's ISA (`amx`, `vec`, `vec16`; the
  builder picks it with `_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)`), which
  packs each (block, head) region: K transposed / in token groups, V in token pairs for AMX;
* kvconnectors describes the same caches as TieredConnector's worker does (`detect_layout`,
  `geometry_row_layout`), and `head_runs` says which bytes of a row are head h's.

For each head h, only head h's K and V are non-zero (every byte of every element non-zero, so
a byte the writer fills from head h is a non-zero byte of the cache). The non-zero bytes of each
written block must be exactly head h's ranges (a fully written block) or inside them (a partly
written one, with every written token's bytes accounted for), the ranges must hold exactly
head h's elements (a permutation of them), and nothing else of the cache may change. Negative
controls run the same check with wrong ranges (shifted by one element, another head's, a
logical per-token slot) and require it to reject them.

What runs where. vLLM's ISA choice is pure Python over two of torch's queries
(`torch.cpu._is_amx_tile_supported`, `torch.cpu._is_avx512_supported`), so the `host` fixture
answers them as on an `avx2` host (neither: this CI machine, an AMD EPYC), an `avx512` host
(no AMX) or an `amx` host (AMX and AVX-512), and every ISA-choice and packing-label check runs on
any x86 host: CASES give the choice on `avx512` and `amx` hosts, and an `avx2` host picks `vec` /
`vec16` (never `amx`) and refuses fp8 caches (`_get_attn_isa` raises "FP8 KV cache on CPU
requires x86 with AVX-512 or AMX.", so vLLM never starts; kvconnectors' label refuses with it).
`test_what_vllm_picks_on_this_host_its_writer_runs` asks vLLM unpatched and requires this build
to have a kernel for whatever it picks here.

The writer, `cpu_attn_reshape_and_cache`, is native code from the kernel library vLLM loads for
the real CPU (`vllm._C_AVX2` without AVX-512, `_C_AVX512` or `_C` with it), and that library
decides which (ISA, dtype, KV cache dtype, head size) kernels exist. `writer_missing` probes the
op once per combination on a tiny cache: only its "Unsupported CPU attention configuration"
RuntimeError means "no kernel here" and skips, with a reason naming the ISA, dtype and host
(tests/allowed_skips.txt allows exactly those of vLLM 0.32 on an AVX2 host); any other error
fails. On an AVX-512 host (no AMX), where this module was written, every writer check runs
(the `amx` packing is plain stores, so its writer runs without AMX). On this AVX2 host (vLLM
0.32.0, `_C_AVX2`) the `vec` and `vec16` writers for fp32/bf16/fp16 caches run; there is no `amx`
kernel for any dtype and no fp8-cache `vec` kernel, so 17 tests skip: the writer cases for `amx`
and for fp8 caches, and the three comparing `amx` bytes with `vec` bytes (bf16 heads 32 and
128, and fp8). ISAs no x86 build compiles (neon, vxe, vsx, rvv, amx_fp8) are not checked; a
missing op (no CPU build) fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

from kvconnectors.mover.heads import HeadRange
from kvconnectors.mover.reslice import RowLayout, geometry_row_layout, head_runs
from kvconnectors.tiered.layout import detect_layout

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
WRITTEN_LAYER = 1       # layer 0 must stay untouched
NUM_BLOCKS = 4          # manager blocks
FULL_BLOCK = 1          # every token written
PARTIAL_BLOCK = 3       # some tokens written
PARTIAL_TOKENS = (0, 3, 6)  # token offsets inside PARTIAL_BLOCK (plus the block's last token)
SEED = 20

Ranges = Callable[[RowLayout, int], list[tuple[int, int]]]   # (row layout, head) -> [(start, stop)) in a row


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype          # model dtype (K/V inputs)
    head_size: int
    block_size: int             # manager block (vLLM's --block-size)
    isa: str                    # what vLLM's _get_attn_isa picks for it on `host`
    host: str                   # "avx512" (AVX-512, no AMX) or "amx" (an AMX host); see HOSTS
    cache_dtype: str = "auto"
    kernel_block_size: int | None = None   # None: the manager block

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def fp8(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        kv = f"-{self.cache_dtype}" if self.fp8 else ""
        split = f"/k{self.kernel_block_size}" if self.kernel_block_size else ""
        return f"{dt}{kv}-d{self.head_size}-b{self.block_size}{split}-{self.isa}-{self.host}"


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    # the tiny test models (head_dim 32, block 32: kvconnectors.testing), fp32 and bf16, and head_dim 128
    Case(F32, 32, 32, "vec", "avx512"),
    Case(F32, 128, 32, "vec", "avx512"),
    Case(BF16, 32, 32, "vec", "avx512"),
    Case(BF16, 128, 32, "vec", "avx512"),
    Case(BF16, 32, 32, "amx", "amx"),
    Case(BF16, 128, 32, "amx", "amx"),
    Case(F16, 32, 32, "vec", "avx512"),
    Case(F16, 128, 32, "vec", "avx512"),
    # head sizes that are multiples of 16 but not 32: vec16 whatever the host
    Case(F32, 80, 32, "vec16", "avx512"),
    Case(BF16, 80, 32, "vec16", "amx"),
    Case(F16, 112, 32, "vec16", "avx512"),
    # block 16 (what _get_attn_isa answers for it; vLLM 0.32's CPU_ATTN asks for kernel blocks MultipleOf(32))
    Case(F32, 32, 16, "vec16", "avx512"),
    Case(BF16, 128, 16, "vec16", "amx"),
    # manager blocks of two kernel blocks (the S axis of a row)
    Case(F32, 32, 64, "vec", "avx512", kernel_block_size=32),
    Case(BF16, 64, 64, "amx", "amx", kernel_block_size=32),
    # fp8 KV caches (uint8 pages, per-tensor scales): vec, or amx for bf16 on an AMX host
    Case(BF16, 32, 32, "vec", "avx512", cache_dtype="fp8_e4m3"),
    Case(BF16, 128, 32, "amx", "amx", cache_dtype="fp8_e4m3"),
    Case(F32, 128, 32, "vec", "avx512", cache_dtype="fp8_e5m2"),
    Case(BF16, 64, 32, "amx", "amx", cache_dtype="fp8_e5m2"),
]
HEADS = (2, 4)   # the tiny model's KV heads, and more than two (heads in the middle of a block)


# ------------------------------------------------------------------------------ vLLM's side
# What `_get_attn_isa` reads of the CPU, per kind of x86 host: (AMX tiles, AVX-512).
HOSTS = {"avx2": (False, False), "avx512": (False, True), "amx": (True, True)}


def _host_kind(amx: bool, avx512: bool) -> str:
    return next(kind for kind, flags in HOSTS.items() if flags == (amx, avx512))


# This machine as vLLM sees it, read before any test fakes a host (torch's own queries).
THIS_HOST = _host_kind(torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_supported())
THIS_CPU = torch.backends.cpu.get_cpu_capability() + {"avx2": ", no AVX-512", "avx512": ", no AMX",
                                                     "amx": ", AMX"}[THIS_HOST]


def load_vllm_kernels() -> None:
    """vLLM loads its kernel library for the real CPU when `vllm._custom_ops` is first imported
    (platform import_kernels, which asks `_is_avx512_supported`): done before a host is faked."""
    import vllm._custom_ops  # noqa: F401


@pytest.fixture
def host(monkeypatch):
    """Ask vLLM's ISA choice as on `kind` of host (HOSTS): only its AMX and AVX-512 queries differ."""
    load_vllm_kernels()

    def set_host(kind: str) -> None:
        amx, avx512 = HOSTS[kind]
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    return set_host


FP8_REFUSED = r"^FP8 KV cache on CPU requires x86 with AVX-512 or AMX\.$"   # _get_attn_isa, no AVX-512/AMX


def avx2_isa(case: Case) -> str | None:
    """What vLLM 0.32 picks for `case` on an AVX2 host: no AMX, and fp8 caches refused (None)."""
    return None if case.fp8 else ("vec" if case.isa == "amx" else case.isa)


# ------------------------------------------------------------------------------ the writer's kernels
NO_KERNEL = "Unsupported CPU attention configuration:"   # the op's dispatch finding no kernel


@functools.lru_cache(maxsize=None)
def writer_missing(isa: str, dtype: torch.dtype, cache_dtype: str, head_size: int) -> str | None:
    """None if this machine's vLLM build writes (isa, dtype, cache_dtype, head_size) caches; else the
    skip reason, quoting the op's RuntimeError. Probed once on a one-block, one-head cache, exactly
    as do_kv_cache_update calls the op; any other error propagates (the test fails)."""
    import vllm
    import vllm._custom_ops as ops

    block = 32
    fp8 = cache_dtype != "auto"
    cache = torch.zeros(1, 1, 2 * block, head_size, dtype=torch.uint8 if fp8 else dtype)
    kv = torch.ones(1, 1, head_size, dtype=dtype)
    try:
        ops.cpu_attn_reshape_and_cache(kv, kv, cache[:, :, :block], cache[:, :, block:],
                                       torch.tensor([0], dtype=torch.long), isa, kv_cache_dtype=cache_dtype)
    except RuntimeError as exc:
        if not str(exc).startswith(NO_KERNEL):
            raise
        return writer_skip_reason(".".join(vllm.__version__.split(".")[:2]), isa, str(dtype).removeprefix("torch."),
                                  cache_dtype if fp8 else "", THIS_CPU, str(exc).splitlines()[0])
    return None


def writer_skip_reason(version: str, isa: str, dtype: str, cache_dtype: str, cpu: str, error: str) -> str:
    """The skip reason of a writer check whose kernel this host's vLLM build lacks (the allowlist's
    test builds the AVX2 host's with it too)."""
    what = dtype + (f" with an {cache_dtype} KV cache" if cache_dtype else "")
    return f"cpu_attn_reshape_and_cache: vLLM {version}'s CPU build has no {isa} kernel for {what} on this host ({cpu}): {error}"


def require_writer(isa: str, dtype: torch.dtype, cache_dtype: str, head_size: int) -> None:
    reason = writer_missing(isa, dtype, cache_dtype, head_size)
    if reason:
        pytest.skip(reason)


def allocate(case: Case, heads: int) -> dict[str, torch.Tensor]:
    """The per-layer caches exactly as vLLM's worker allocates them for CPU_ATTN."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    dtype = STR_DTYPE_TO_TORCH_DTYPE[case.cache_dtype] if case.fp8 else case.dtype
    spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=heads, head_size=case.head_size, dtype=dtype)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(LAYERS), layers=list(LAYERS),
                           layer_stride=page * NUM_BLOCKS, block_stride=page)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [case.kernel])
    t = caches[LAYERS[0]]
    assert tuple(t.shape) == (NUM_BLOCKS * case.block_size // case.kernel, heads, case.kernel, 2 * case.head_size)
    assert t.dtype == dtype and t.is_contiguous()
    assert all(int(c.view(torch.uint8).count_nonzero()) == 0 for c in caches.values())
    return caches


def backend_impl(case: Case, heads: int, monkeypatch):
    """vLLM's CPUAttentionBackendImpl for the layer; its constructor reads the current vLLM config
    for one thing only (zentorch SDPA for encoder attention), answered here with the model dtype."""
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=case.dtype)))
    return cpu_attn.CPUAttentionBackendImpl(num_heads=heads * 2, head_size=case.head_size,
                                            scale=case.head_size ** -0.5, num_kv_heads=heads, alibi_slopes=None,
                                            sliding_window=None, kv_cache_dtype=case.cache_dtype)


def write(impl, isa: str, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int]) -> None:
    """One KV cache update as the model runner does it (the builder set `layer.isa`)."""
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    impl.do_kv_cache_update(layer, key, value, cache, torch.tensor(slots, dtype=torch.long))


# ------------------------------------------------------------------------------ inputs
def distinct_values(dtype: torch.dtype, n: int, rng: np.random.Generator) -> torch.Tensor:
    """n distinct finite normal values of `dtype` whose every byte is non-zero."""
    es = torch.empty((), dtype=dtype).element_size()
    bits = {2: np.uint16, 4: np.uint32}[es]
    if es == 2:
        cand = np.arange(1 << 16, dtype=np.uint32).astype(bits)
    else:
        cand = np.unique(rng.integers(0, 1 << 32, size=8 * n, dtype=np.uint64).astype(bits))
    ok = np.ones(cand.shape, dtype=bool)
    for i in range(es):
        ok &= ((cand >> (8 * i)) & 0xFF) != 0
    vals = torch.from_numpy(cand.view({2: np.int16, 4: np.int32}[es])).view(dtype).float()
    ok &= (torch.isfinite(vals) & (vals.abs() >= torch.finfo(dtype).tiny)).numpy()
    cand = cand[ok]
    assert len(cand) >= n, f"only {len(cand)} usable {dtype} values for {n}"
    picked = rng.choice(cand, size=n, replace=False)
    return torch.from_numpy(picked.view({2: np.int16, 4: np.int32}[es]).copy()).view(dtype)


def head_inputs(case: Case, heads: int, h: int, tokens: int, rng: np.random.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [tokens, heads, head_size]: zero but head h. Plain caches: distinct values with no
    zero byte (a copy lands non-zero bytes); fp8: magnitudes in [0.5, 3.5) (non-zero fp8 codes)."""
    key = torch.zeros(tokens, heads, case.head_size, dtype=case.dtype)
    value = torch.zeros_like(key)
    n = tokens * case.head_size
    if case.fp8:
        mag = rng.uniform(0.5, 3.5, size=2 * n) * rng.choice([-1.0, 1.0], size=2 * n)
        vals = torch.from_numpy(mag).to(case.dtype)
    else:
        vals = distinct_values(case.dtype, 2 * n, rng)
    key[:, h] = vals[:n].view(tokens, case.head_size)
    value[:, h] = vals[n:].view(tokens, case.head_size)
    return key, value


# ------------------------------------------------------------------------------ ranges and the check
def kvconnectors_ranges(rl: RowLayout, h: int) -> list[tuple[int, int]]:
    offsets, size = head_runs(rl, HeadRange(h, h + 1))
    return [(int(o), int(o) + size) for o in offsets]


def shifted_by_one_element(es: int) -> Ranges:
    return lambda rl, h: [(a + es, b + es) for a, b in kvconnectors_ranges(rl, h)]


def next_head(rl: RowLayout, h: int) -> list[tuple[int, int]]:
    return kvconnectors_ranges(rl, (h + 1) % rl.heads)


def logical_token_slots(tokens: list[int], kernel: int) -> Ranges:
    """The cache's logical shape read literally, [kernel blocks, H, N, 2 * head_size]: token t of head h at
    row bytes (t // kernel, h, t % kernel) * C. Not what kvconnectors claims; must be rejected."""
    def ranges(rl: RowLayout, h: int) -> list[tuple[int, int]]:
        dims = dict(rl.dims)
        H, N, C = dims["H"], dims["N"], dims["C"]
        return [(((t // kernel) * H + h) * N * C + (t % kernel) * C,
                 ((t // kernel) * H + h) * N * C + (t % kernel + 1) * C) for t in tokens]
    return ranges


def mask_of(rl: RowLayout, ranges: list[tuple[int, int]]) -> np.ndarray:
    m = np.zeros(rl.row_bytes, dtype=bool)
    for a, b in ranges:
        m[max(a, 0):min(b, rl.row_bytes)] = True
    return m


def problems(rows: np.ndarray, other_layer: np.ndarray, rl: RowLayout, h: int, ranges: Ranges,
             partial_bytes: int, elems: dict[int, np.ndarray] | None, es: int) -> list[str]:
    """What is wrong with `ranges` as head h's bytes, given a cache where only head h was written:
    `rows` uint8 [blocks, row_bytes] of the written layer (FULL_BLOCK every token, PARTIAL_BLOCK
    `partial_bytes` bytes' worth of tokens); `elems`: per block the element bits head h wrote (plain caches)."""
    out = []
    if other_layer.any():
        out.append(f"layer {1 - WRITTEN_LAYER} changed at {int(other_layer.sum())} bytes")
    bounds = [(a, b) for a, b in ranges(rl, h) if not 0 <= a < b <= rl.row_bytes]
    if bounds:
        out.append(f"ranges {bounds[:3]} are not inside a {rl.row_bytes}-byte row")
    m = mask_of(rl, ranges(rl, h))
    nz = rows != 0
    for b in range(rows.shape[0]):
        where = np.flatnonzero(nz[b])
        outside = where[~m[where]]
        if b not in (FULL_BLOCK, PARTIAL_BLOCK):
            if where.size:
                out.append(f"block {b} (not written) has {where.size} non-zero bytes, first at {where[:4].tolist()}")
            continue
        if outside.size:
            out.append(f"block {b}: {outside.size} of head {h}'s bytes lie outside its ranges, first at "
                       f"{outside[:4].tolist()} (ranges {ranges(rl, h)[:3]}...)")
        if b == FULL_BLOCK:
            missing = np.flatnonzero(m & ~nz[b])
            if missing.size:
                out.append(f"block {b} (every token written): {missing.size} bytes of head {h}'s ranges hold "
                           f"no head-{h} data, first at {missing[:4].tolist()}")
        elif where.size != partial_bytes:
            out.append(f"block {b}: {where.size} non-zero bytes, the written tokens hold {partial_bytes}")
        if elems is not None and not out:
            got = np.sort(np.concatenate([rows[b, s:e] for s, e in ranges(rl, h)]).view(f"<u{es}"))
            got = got[got != 0]
            if not np.array_equal(got, np.sort(elems[b])):
                out.append(f"block {b}: head {h}'s ranges do not hold exactly head {h}'s elements")
    return out


# ------------------------------------------------------------------------------ tests
def test_vllm_cpu_writer_is_there() -> None:
    """The op and the backend method the checks below drive (an AttributeError here: no CPU build)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    schema = str(torch.ops._C.cpu_attn_reshape_and_cache.default._schema)
    assert "str isa" in schema and "Tensor(a2!) key_cache" in schema, schema
    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    assert [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()] == ["LBHNC"]
    assert callable(CPUAttentionBackendImpl.do_kv_cache_update)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_vllm_cpu_writer_keeps_each_head_in_kvconnectors_ranges(case: Case, heads: int, host, monkeypatch) -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    host(case.host)
    cache_dtype = case.cache_dtype if case.fp8 else None
    assert _get_attn_isa(case.dtype, case.kernel, case.head_size, cache_dtype) == case.isa, \
        "vLLM's ISA choice changed: update CASES"
    require_writer(case.isa, case.dtype, case.cache_dtype, case.head_size)
    impl = backend_impl(case, heads, monkeypatch)
    rng = np.random.default_rng(SEED)
    tokens_partial = sorted({*PARTIAL_TOKENS, case.block_size - 1})
    wrong_seen = {"shifted by one element": 0, "next head's": 0, "logical token slots": 0}
    for h in range(heads):
        caches = allocate(case, heads)
        _, geometry = detect_layout(caches, case.block_size, "LBHNC", backend="CPU_ATTN",
                                    cache_dtype=case.cache_dtype)
        rl = geometry_row_layout(geometry)
        assert geometry.kernel_splits == case.block_size // case.kernel and rl.heads == heads

        # FULL_BLOCK: every token, in shuffled order; PARTIAL_BLOCK: a few tokens
        full = rng.permutation(case.block_size).tolist()
        slots = [FULL_BLOCK * case.block_size + t for t in full] + \
                [PARTIAL_BLOCK * case.block_size + t for t in tokens_partial]
        key, value = head_inputs(case, heads, h, len(slots), rng)
        write(impl, case.isa, caches[LAYERS[WRITTEN_LAYER]], key, value, slots)

        rows = geometry.views[WRITTEN_LAYER].reshape(geometry.num_blocks, -1).numpy()
        assert rows.shape[1] == rl.row_bytes == geometry.block_bytes
        other = geometry.views[1 - WRITTEN_LAYER].reshape(geometry.num_blocks, -1).numpy() != 0
        es = caches[LAYERS[0]].element_size()
        partial_bytes = len(tokens_partial) * 2 * case.head_size * es
        elems = None
        if not case.fp8:
            bits = {2: np.uint16, 4: np.uint32}[es]
            kv = torch.stack([key[:, h], value[:, h]], 1).contiguous().view(torch.uint8).numpy().view(bits)
            elems = {FULL_BLOCK: kv[:case.block_size].ravel(), PARTIAL_BLOCK: kv[case.block_size:].ravel()}
            assert np.all(kv != 0)

        found = problems(rows, other, rl, h, kvconnectors_ranges, partial_bytes, elems, es)
        assert not found, f"{case.id}, {heads} heads, head {h}: vLLM's writer disagrees with head_runs:\n" + \
            "\n".join(found)

        # negative controls: the same check rejects ranges that are off
        wrong = {"shifted by one element": shifted_by_one_element(es), "next head's": next_head,
                 "logical token slots": logical_token_slots(tokens_partial, case.kernel)}
        for name, ranges in wrong.items():
            bad = problems(rows, other, rl, h, ranges, partial_bytes, elems, es)
            if name == "logical token slots":  # a claim about the partly written block's tokens only
                bad = [p for p in bad if p.startswith(f"block {PARTIAL_BLOCK}:")]
            assert bad, f"{case.id}, head {h}: the check accepted {name} ranges"
            wrong_seen[name] += 1
    assert all(n == heads for n in wrong_seen.values()), wrong_seen


def label_params() -> list:
    return [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("case", label_params())
def test_kvconnectors_packing_label_is_the_isa_vllm_packs_with(case: Case, host) -> None:
    """The `packing` of kvconnectors' fingerprint (layout_of -> cpu_attention_packing) must name the ISA
    vLLM's builder gives the layer (`_get_attn_isa(model dtype, block_size, head_size, kv_cache_dtype)`):
    the model's dtype, which for an fp8 cache is not the cache tensor's (uint8). It was asked with the
    cache's dtype until this test found fp8 caches on AMX hosts labelled 'vec'."""
    host(case.host)
    layout, _ = detect_layout(allocate(case, 2), case.block_size, "LBHNC", backend="CPU_ATTN",
                              cache_dtype=case.cache_dtype, model_dtype=case.dtype)
    assert layout.packing == case.isa


@pytest.mark.parametrize("case", label_params())
def test_an_avx2_host_packs_vec_and_refuses_fp8_caches(case: Case, host) -> None:
    """On a host without AVX-512 or AMX (this CI machine) vLLM picks no `amx` packing and refuses an
    fp8 KV cache outright (`_get_attn_isa` raises: no engine starts), so kvconnectors' label refuses
    with it rather than naming a packing vLLM never writes."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    host("avx2")
    caches = allocate(case, 2)
    expected = avx2_isa(case)
    if expected is None:
        with pytest.raises(NotImplementedError, match=FP8_REFUSED):
            _get_attn_isa(case.dtype, case.kernel, case.head_size, case.cache_dtype)
        with pytest.raises(NotImplementedError, match=FP8_REFUSED):
            detect_layout(caches, case.block_size, "LBHNC", backend="CPU_ATTN", cache_dtype=case.cache_dtype,
                          model_dtype=case.dtype)
        return
    assert _get_attn_isa(case.dtype, case.kernel, case.head_size, None) == expected
    layout, _ = detect_layout(caches, case.block_size, "LBHNC", backend="CPU_ATTN", model_dtype=case.dtype)
    assert layout.packing == expected


@pytest.mark.parametrize("case", label_params())
def test_what_vllm_picks_on_this_host_its_writer_runs(case: Case, host) -> None:
    """vLLM asked on this very machine, nothing faked: it answers as the modelled host of its kind
    (THIS_HOST: only the AMX and AVX-512 queries matter), and whatever ISA it picks here this
    machine's kernel library writes; what it cannot write it refuses (only fp8 caches, only
    without AVX-512 or AMX)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    def choice() -> str:
        try:
            return _get_attn_isa(case.dtype, case.kernel, case.head_size, case.cache_dtype if case.fp8 else None)
        except NotImplementedError as exc:
            return f"refused: {exc}"

    load_vllm_kernels()
    real = choice()
    host(THIS_HOST)
    assert real == choice(), f"vLLM on this {THIS_HOST} host answers otherwise than HOSTS[{THIS_HOST!r}] models"
    if real.startswith("refused: "):
        assert case.fp8 and THIS_HOST == "avx2", real
        assert avx2_isa(case) is None
        return
    assert writer_missing(real, case.dtype, case.cache_dtype, case.head_size) is None, \
        f"vLLM picks {real!r} for {case.id} on this host, whose kernel library cannot write it"


def test_writer_probe_tells_missing_kernels_from_other_errors() -> None:
    """The probe behind the skips: a kernel every x86 build has is there, one no x86 build has
    (neon) is reported missing with the op's own message, and an error other than a missing kernel
    (an ISA the op does not know) propagates instead of becoming a skip."""
    load_vllm_kernels()
    assert writer_missing("vec", F32, "auto", 32) is None
    neon = writer_missing("neon", F32, "auto", 32)
    assert neon is not None and neon.startswith("cpu_attn_reshape_and_cache: vLLM ") and \
        neon.endswith(f"has no neon kernel for float32 on this host ({THIS_CPU}): {NO_KERNEL} "
                      "head_dim=32 isa=3 kv_cache_idx=0"), neon
    with pytest.raises(RuntimeError, match="Invalid ISA type: nosuchisa"):
        writer_missing("nosuchisa", F32, "auto", 32)


def test_fp8_cache_fingerprint_tells_amx_from_vec_hosts(host) -> None:
    """A bf16 model with an fp8 KV cache: vLLM packs it 'amx' on an AMX host and 'vec' on an
    AVX-512 one, so the two hosts' fingerprints must differ (the bytes do:
    test_fp8_amx_and_vec_write_the_same_tokens_as_different_bytes)."""
    fingerprints = {}
    for kind in ("avx512", "amx"):
        host(kind)
        case = Case(BF16, 128, 32, "", kind, cache_dtype="fp8_e4m3")
        layout, _ = detect_layout(allocate(case, 2), 32, "LBHNC", backend="CPU_ATTN", cache_dtype="fp8_e4m3",
                                  model_dtype=BF16)
        fingerprints[layout.packing] = layout.fingerprint
    assert sorted(fingerprints) == ["amx", "vec"] and fingerprints["amx"] != fingerprints["vec"]


def test_fp8_amx_and_vec_write_the_same_tokens_as_different_bytes(monkeypatch) -> None:
    """Why the fingerprints above must differ: vLLM's `amx` and `vec` writers store the same bf16
    tokens into an fp8 cache as different bytes."""
    load_vllm_kernels()
    for isa in ("vec", "amx"):
        require_writer(isa, BF16, "fp8_e4m3", 128)
    rows, key, value = {}, None, None
    for isa in ("vec", "amx"):
        case = Case(BF16, 128, 32, isa, "amx" if isa == "amx" else "avx512", cache_dtype="fp8_e4m3")
        if key is None:
            key, value = head_inputs(case, 2, 0, 32, np.random.default_rng(SEED))
        caches = allocate(case, 2)
        write(backend_impl(case, 2, monkeypatch), isa, caches[LAYERS[0]], key, value,
              list(range(FULL_BLOCK * 32, FULL_BLOCK * 32 + 32)))
        block = caches[LAYERS[0]][FULL_BLOCK].contiguous().view(torch.uint8).numpy().ravel()
        assert block.any(), f"the {isa} writer wrote nothing"
        rows[isa] = block.copy()
    assert not np.array_equal(rows["amx"], rows["vec"])


def test_kvconnectors_head_ranges_partition_a_row(host) -> None:
    """Heads' ranges are disjoint and cover the row, for every case's row (so 'inside head h's
    ranges' above also means 'in no other head's')."""
    for case in CASES:
        host(case.host)
        for heads in HEADS:
            caches = allocate(case, heads)
            _, geometry = detect_layout(caches, case.block_size, "LBHNC", backend="CPU_ATTN",
                                        cache_dtype=case.cache_dtype)
            rl = geometry_row_layout(geometry)
            count = np.zeros(rl.row_bytes, dtype=np.int64)
            for h in range(heads):
                count += mask_of(rl, kvconnectors_ranges(rl, h))
            assert (count == 1).all(), f"{case.id}, {heads} heads: head ranges overlap or leave gaps"


@pytest.mark.parametrize("head_size", [32, 128])
def test_vec_and_amx_pack_the_same_head_differently_within_the_same_range(head_size: int, host,
                                                                         monkeypatch) -> None:
    """Why the ISA is part of the fingerprint: one bf16 block written with vLLM's `vec` and `amx`
    packings holds different bytes, yet in both each head's bytes are its kvconnectors range."""
    for isa in ("vec", "amx"):
        require_writer(isa, BF16, "auto", head_size)
    heads, rng = 2, np.random.default_rng(SEED)
    vec, amx = Case(BF16, head_size, 32, "vec", "avx512"), Case(BF16, head_size, 32, "amx", "amx")
    key, value = head_inputs(vec, heads, 0, 32, rng)
    key1, value1 = head_inputs(vec, heads, 1, 32, rng)
    key[:, 1], value[:, 1] = key1[:, 1], value1[:, 1]
    rows = {}
    for case in (vec, amx):
        host(case.host)
        caches = allocate(case, heads)
        write(backend_impl(case, heads, monkeypatch), case.isa, caches[LAYERS[0]], key, value,
              list(range(FULL_BLOCK * 32, FULL_BLOCK * 32 + 32)))
        _, geometry = detect_layout(caches, 32, "LBHNC", backend="CPU_ATTN")
        rl = geometry_row_layout(geometry)
        rows[case.isa] = geometry.views[0].reshape(geometry.num_blocks, -1).numpy()[FULL_BLOCK].copy()
    assert not np.array_equal(rows["vec"], rows["amx"])
    for h in range(heads):
        for a, b in kvconnectors_ranges(rl, h):
            assert not np.array_equal(rows["vec"][a:b], rows["amx"][a:b])
            assert np.array_equal(np.sort(rows["vec"][a:b]), np.sort(rows["amx"][a:b]))


def test_the_worker_labels_an_fp8_cache_by_the_models_dtype(host, monkeypatch) -> None:
    """TieredConnectorWorker passes vLLM's model dtype (model_config.dtype) to the packing label:
    a bf16 model with an fp8_e4m3 cache on an AMX host is 'amx', as vLLM packs it."""
    import kvconnectors.tiered.worker as worker
    from kvconnectors.testing.worker_config import worker_vllm_config
    from kvconnectors.tiered.config import TieredConfig

    host("amx")
    monkeypatch.setattr(worker, "_attention_backend", lambda vllm_config: "CPU_ATTN")
    case = Case(BF16, 128, 32, "amx", "amx", cache_dtype="fp8_e4m3")
    vllm_config = worker_vllm_config("c", 32, 2, cache_dtype="fp8_e4m3", model_dtype=BF16)
    w = worker.TieredConnectorWorker(vllm_config, TieredConfig(dram_bytes="4m"), "c-fp8")
    try:
        w.register_kv_caches(allocate(case, 2))
        assert w.layout.packing == "amx", w.layout.packing
    finally:
        w.shutdown()
