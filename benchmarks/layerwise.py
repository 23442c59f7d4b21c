"""Layer-wise pipelined transfer benchmark: TTFT of one pushed prompt with the prefill alone, with bulk
transfer (every layer in one message after the last layer) and with layer-wise transfer (a message
per group of layers, sent while the later layers compute), side by side in one run, over emulated
links (NVLink, 200 Gb InfiniBand, 100 GbE, 25 GbE), plus a short-prompt section on plain loopback
that shows where layer-wise stops costing more than bulk (the `layerwise_min_tokens` threshold).

What runs is the connector's own push-mode parts, assembled as the worker assembles them
(tiered/worker.py), in one process, with no vLLM: the producer's and the consumer's KV caches are
torch tensors in vLLM's LBHNC layout (one allocation, a [blocks, 1, 1, slot] view per layer), the
bytes move through the connector's data mover (kvconnectors.mover, CpuOps: a copy thread as the copy
stream). After every layer's compute the "forward" calls the producer's StagingBook.save_layer (what
the worker's save_kv_layer calls): its staging thread has the Stager copy the layer's blocks into
the producer TieredStore and checksum them, and its PushBook sends each full group of --group layers
(layer-wise) through its PushSender over TCP loopback to the consumer's StoreServer, whose Landing
lands, verifies and seals them; at the last layer the staging thread seals the producer's entry and
sends the last group with the seal (bulk: the request's layerwise flag is off, so every layer goes in
that one message). The forward then calls wait_for_save. The consumer's LandedReader.load (what the
worker's Puller calls in push mode) copies the sealed entry into its own KV cache blocks.

  prefill alone   the forward pass only: layers x per-layer compute
  bulk TTFT       prefill start -> the landed entry sealed on the consumer -> copied into its KV
                  cache blocks by LandedReader.load; one message after the last layer
  layer-wise      the same, one message per layer group while later layers compute

Calibration (from kvconnectors.planner, the same presets the planner uses). Per-layer compute =
tokens x 2 x params / (GPU dense peak x MFU) / layers: the 8B preset on an H100 at 40% MFU is
40.4 us per token, so 2,000 tokens take 81 ms, 2.5 ms per layer. The per-layer compute is a
time.sleep to an absolute deadline (a GPU computes while the CPU is free; jitter does not add up).
KV bytes per layer = tokens x 2 (K, V) x KV heads x head dim x dtype bytes (8B: 4 KiB per token per
layer, 128 KiB per token), in whole blocks of --block-tokens.

Scaling ("scaled down proportionally"). This host cannot emulate NVLink at 450 GB/s on loopback, so
time runs S times slower and bytes are D times fewer: one emulated layer sleeps S x its real compute,
each (layer, block) slot carries slot/D bytes (the same number of blocks, layers and messages), and
each link runs at real rate / (S x D) through PushSender's link_bytes_per_s pacing (a group's bytes
arrive when the emulated link would have carried them; jobs queue behind each other; one
StagingBook per link, made with that rate). Every
compute and transfer time is then exactly S x its real value, so times are reported in emulated
seconds and converted back to real ms (/ S). S (--time-scale) defaults to the value that makes one
emulated layer ~25 ms; D (--byte-scale) defaults to the smallest power of two that keeps the fastest
emulated link at or below 1/--link-headroom of what the push path really sustains on loopback here
(measured unpaced at the start). What does not scale: fixed software costs per message (framing,
the Ack round trip, thread wake-ups) and the consumer's copy are real time, so in "real ms" they
appear S times smaller than they are; the short-prompt section measures them unscaled.

Per link it reports: transfer total X and one group's transfer Xg (the emulated link's nominal
time for those bytes), prefill alone P (measured), bulk and layer-wise TTFT (median over --reps),
the pipeline model max(P + Xg, X + P x group/layers) of kvconnectors.planner (Xg = X x
group/layers), and the targets of issue #3:
  - the transfer's overhead on the critical path <= 1.5 x Xg, where the overhead on the critical
    path, TTFT_layerwise - max(P, X), is the connector's software tail (the control below) plus the
    transfer's own part, TTFT_layerwise(link) - TTFT_layerwise(instant link) - (max(P, X) - P),
    paired within each repetition (median over repetitions);
  - where transfer per layer exceeds compute per layer (X > P): TTFT_layerwise ~ max(P, X) + Xg
    (ratio <= 1.1), not their sum (bulk / (max + Xg) shows the sum).
The consumer's copy out of the landing store is inside every TTFT (bulk and layer-wise alike).

The control ("instant link"): each repetition also runs layer-wise with no link emulation (the
unpaced loopback sender). Its TTFT minus the prefill alone is the connector's software tail after
the last layer: staging that layer, sealing, the last Push and its Ack, the landing side's check,
the consumer's copy. No link speed removes it, bulk pays it too, and it is host time: in the
real-ms columns it shows S times smaller than it is. Where one group carries for less than the
tail (NVLink: 0.07 ms), the tail is most of the overhead; it is reported on its own line.

Short-prompt section (no link emulation, S = D = 1, real slot sizes, plain loopback): bulk and
layer-wise TTFT for prompts of --short-tokens tokens with zero compute by default (the case most
unfavourable to layer-wise: nothing to hide its transfer behind, so only its per-group cost shows;
--short-us-per-token calibrated adds the real per-layer compute). Bulk and layer-wise run back to
back in each repetition; their ratio is taken per repetition and the median reported. The
crossover is the shortest prompt from which layer-wise stays within --crossover-tolerance (5%) of
bulk at every longer measured length: below it the per-group messages (Push + Ack each) cost a
visible share of TTFT. It is the measurement behind the connector's layerwise_min_tokens default.
Producer and consumer share one process here (one GIL, this host's cores): with layer-wise their
work overlaps and contends, which a real producer/consumer pair on two hosts does not, so the
crossover measured here is an upper bound.

The landed bytes are verified byte-exact against what was staged once per configuration (the first
repetition), for every link, mode and short-prompt length. Run order: every repetition measures
the prefill alone, then each link (order rotated per repetition) in bulk and layer-wise (order
alternating), so drift on a shared box hits all alike; each link's sender first pushes an untimed
one-block transfer (connection set-up).

Usage:  python -m kvconnectors.benchmarks.layerwise                       (8B, 2,000 tokens, all links)
        kvconnectors bench layerwise --preset 70b --links ib200,25gbe --reps 2
        kvconnectors bench layerwise --links nvlink,10gbe=10 --group 2 --no-short
"""

from __future__ import annotations

import argparse
import contextlib
import math
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvconnectors.benchmarks.common import (DEFAULT_OUT, add_results_argument, host_info, module_main, progress,
                                            publish, setup_env, table)

setup_env()  # harmless here (no NIXL on this path), but keeps UCX sane if a store server ever loads it

import numpy as np  # noqa: E402
import torch  # noqa: E402

import msgspec  # noqa: E402

from kvconnectors import planner  # noqa: E402
from kvconnectors.benchmarks.models import PRESETS, KVBlocks  # noqa: E402
from kvconnectors.tiered.config import TieredConfig  # noqa: E402

FP = "kvc-bench-layerwise"
TIMEOUT_S = 120.0
TARGET_OVERHEAD_GROUPS = 1.5      # issue #3: overhead on the critical path <= 1.5 x one group's transfer
TARGET_MAX_PLUS_GROUP = 1.1       # where X > P: TTFT_layerwise <= 1.1 x (max(P, X) + one group)
LAYER_TARGET_S = 0.025            # auto time scale: one emulated layer computes ~25 ms
PROBE_BYTES = 32 << 20            # loopback probe: one bulk push of about this many bytes
MIN_EMULATED_SLOT = 64            # bytes per emulated (layer, block) slot, at least
DEFAULT_SHORT_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MODEL_PRESETS = {k: PRESETS[k].model.name for k in ("8b", "70b")}   # -> kvconnectors.planner.MODELS
INSTANT = "instant"                # the control sender: no link emulation
MODE_COLOR = {"prefill alone": "#9e9e9e", "bulk": "#ff7f0e", "layer-wise": "#1f77b4"}


# ============================================================================== calibration
@dataclass(frozen=True)
class Calibration(KVBlocks):
    preset: str
    model: planner.ModelSpec
    gpu: planner.GPUSpec
    mfu: float
    tokens: int
    block_tokens: int
    layers: int              # layers emulated (the model's, unless overridden)
    group: int

    @property
    def s_per_token(self) -> float:
        return planner.prefill_s_per_token(self.model, self.gpu, self.mfu)

    @property
    def layer_compute_s(self) -> float:
        """Real compute of one layer for this prompt (the model's per-token cost spread over its layers)."""
        return self.tokens * self.s_per_token / self.model.layers

    @property
    def num_layers(self) -> int:  # the emulated layers: KVBlocks' sizes are of what actually moves
        return self.layers

    @property
    def blocks(self) -> int:
        return self.num_blocks

    def describe(self) -> dict[str, Any]:
        return {"preset": self.preset, "model": self.model.name, "params": self.model.params,
                "model_layers": self.model.layers, "layers": self.layers, "gpu": self.gpu.name,
                "gpu_peak_tflops": self.gpu.peak_tflops, "mfu": self.mfu, "tokens": self.tokens,
                "block_tokens": self.block_tokens, "blocks": self.blocks, "group": self.group,
                "us_per_token": self.s_per_token * 1e6, "layer_compute_ms": self.layer_compute_s * 1e3,
                "prefill_ms": self.layers * self.layer_compute_s * 1e3,
                "kv_bytes_per_token": self.model.kv_bytes_per_token, "slot_bytes": self.slot_bytes,
                "layer_bytes": self.layer_bytes, "total_bytes": self.total_bytes}


def parse_links(text: str | Sequence[str]) -> list[planner.LinkSpec]:
    """'all', or names of kvconnectors.planner.LINKS, or NAME=GBIT for a custom line rate in Gbit/s."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if not items or items == ["all"]:
        return list(planner.LINKS.values())
    if items == ["none"]:
        return []
    out: list[planner.LinkSpec] = []
    for item in items:
        name, eq, rate = item.partition("=")
        if eq:
            try:
                out.append(planner.LinkSpec(name.strip(), float(rate)))
            except Exception as exc:  # float() or LinkSpec's ConfigError
                raise ValueError(f"link {item!r}: expected NAME=GBIT with a rate in Gbit/s > 0 ({exc})") from None
        elif item in planner.LINKS:
            out.append(planner.LINKS[item])
        else:
            raise ValueError(f"unknown link {item!r}; choose from {', '.join(planner.LINKS)} or NAME=GBIT")
    if len({lk.name for lk in out}) != len(out):
        raise ValueError("link names must be distinct")
    return out


def parse_tokens(text: str | Sequence[int]) -> list[int]:
    if isinstance(text, str):
        if text.strip().lower() in ("", "none"):
            return []
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--short-tokens {text!r}: expected comma-separated token counts") from None
    else:
        vals = [int(x) for x in text]
    if any(v < 1 for v in vals):
        raise ValueError("prompt lengths must be >= 1 token")
    return sorted(set(vals))


def default_min_tokens() -> int:
    """TieredConfig's declared layerwise_min_tokens default: the threshold the short-prompt section
    measures (kvconnectors.tiered.config imports neither torch nor vLLM)."""
    return next(f.default for f in msgspec.structs.fields(TieredConfig) if f.name == "layerwise_min_tokens")


# ============================================================================== the push path under test
def kv_caches(kv: np.ndarray) -> dict[str, torch.Tensor]:
    """vLLM-style per-layer caches over one [layers, blocks, slot] uint8 allocation: LBHNC, one
    [blocks, heads 1, tokens 1, slot] view per layer (a block is one slot of opaque bytes), sharing
    `kv`'s memory."""
    layers, blocks, slot = kv.shape
    full = torch.from_numpy(kv).view(layers, blocks, 1, 1, slot)
    return {f"model.layers.{i}.self_attn.attn": full[i] for i in range(layers)}


class Payload:
    """The producer's and the consumer's KV cache as [layers, cache_blocks, slot] arrays (`src`, `dst`;
    kv_caches() gives vLLM's view of them), and the (random, non-contiguous) block ids a request's
    blocks sit at on each side."""

    def __init__(self, layers: int, blocks: int, slot: int, seed: int):
        rng = np.random.default_rng(seed)
        n = layers * blocks * slot
        words = rng.integers(0, 2**63, (n + 7) // 8, dtype=np.uint64)  # 8 random bytes at a time: fast
        self.src = words.view(np.uint8)[:n].reshape(layers, blocks, slot)
        self.dst = np.zeros_like(self.src)
        self.src_ids = rng.permutation(blocks)
        self.dst_ids = rng.permutation(blocks)
        self.stamp = 0

    def prepare_check(self, n: int) -> None:
        """Before a verified run: a fresh stamp in every source slot, a cleared destination."""
        self.stamp += 1
        self.src[:, self.src_ids[:n], :8] = np.frombuffer(self.stamp.to_bytes(8, "little"), dtype=np.uint8)
        self.dst[:] = 0

    def check(self, n: int) -> None:
        want = self.src[:, self.src_ids[:n]]
        got = self.dst[:, self.dst_ids[:n]]
        if not np.array_equal(got, want):
            bad = np.argwhere((got != want).any(axis=2))[0]
            raise AssertionError(f"landed KV differs from the staged KV at layer {bad[0]}, block {bad[1]}")
        others = np.ones(self.dst.shape[1], bool)
        others[self.dst_ids[:n]] = False
        if self.dst[:, others].any():
            raise AssertionError("the consumer copy wrote outside the request's blocks")


class Rig:
    """The connector's push-mode parts, as the worker assembles them (tiered/worker.py), over a
    Payload's caches: producer TieredStore + Stager + StoreServer + one StagingBook per emulated link
    (its staging thread, seal and PushBook; the link's pacing rate is fixed per book) -> consumer
    landing TieredStore served by a StoreServer with a Landing, and the consumer's LandedReader with
    its Loader. Everything is closed by close(), also after a failure half-way through __init__."""

    def __init__(self, kv: Payload, group: int, entries: float, tag: str):
        from kvconnectors.mover import CpuOps, Loader, Stager
        from kvconnectors.mover.geometry import UnsupportedKVCache
        from kvconnectors.mover.reslice import geometry_row_layout
        from kvconnectors.store import StoreConfig, TieredStore
        from kvconnectors.tiered.landed import LandedReader  # (imports vLLM: seconds, so not at the top)
        from kvconnectors.tiered.layout import detect_layout
        from kvconnectors.tiered.links import PeerLinks
        from kvconnectors.tiered.pull_paths import PullPaths
        from kvconnectors.tiered.resliced import ReslicedReads
        from kvconnectors.tiered.results import LoadResults
        from kvconnectors.tiered.staging import StagingFailures
        from kvconnectors.transport.landing import Landing
        from kvconnectors.transport.paths import TCP_PUSH
        from kvconnectors.transport.server import StoreServer

        self.layers, self.blocks, self.slot = kv.src.shape
        self.group = group
        # as the connector runs push mode: `group` layers per message, checksums on
        self.config = TieredConfig(transfer_mode="push", layer_group_size=group, checksum=True,
                                   load_timeout_s=TIMEOUT_S, connect_timeout_s=10, lease_ttl_s=600)
        self.results = LoadResults()  # every part records its counters here, as in the worker
        self.books: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()
        try:
            layout, src_geometry = detect_layout(kv_caches(kv.src), block_size=1, cache_layout="LBHNC")
            dst_layout, dst_geometry = detect_layout(kv_caches(kv.dst), block_size=1, cache_layout="LBHNC")
            self.layout, self.dst_layout = layout, dst_layout
            try:
                self.row_layout: Any = geometry_row_layout(src_geometry)
            except UnsupportedKVCache as exc:  # (same TP size on both sides: not needed)
                self.row_layout = exc
            dram = max(math.ceil(entries * self.layers * self.blocks), 4) * self.slot  # runs go one at a time
            # each side's copy stream (on a CPU engine: a copy thread); two processes in a real deployment
            self.src_ops = self._closing(CpuOps("bench-copy-src"))
            self.dst_ops = self._closing(CpuOps("bench-copy-dst"))
            # ---- producer: its store, Stager and store server (grants, staging failures)
            self.src = self._closing(TieredStore(StoreConfig(slot_bytes=self.slot, dram_bytes=dram, lease_ttl_s=600,
                                                             instance_name=f"benchlw{tag}src")))
            self.stager = Stager(src_geometry, self.src, self.src_ops, checksum=True)
            self.failures = StagingFailures()
            self.src_server = self._closing(StoreServer(
                self.src, "127.0.0.1", 0, fingerprint=layout.fingerprint, rows_fingerprint=layout.rows_fingerprint,
                num_layers=self.layers, compat=self.config.compat, staging_failure=self.failures.get,
                require_grants=True, tp_size=1))
            self.links = self._closing(PeerLinks(self.config, f"bench-lw{tag}-p", None))
            # ---- consumer: its landing store, Landing, store server and LandedReader
            self.dst = self._closing(TieredStore(StoreConfig(slot_bytes=self.slot, dram_bytes=dram, lease_ttl_s=600,
                                                             instance_name=f"benchlw{tag}dst")))
            self.landing = self._closing(Landing(self.dst, fingerprint=dst_layout.rows_fingerprint,
                                                 num_layers=self.layers, paths=[TCP_PUSH]))
            self.server = self._closing(StoreServer(
                self.dst, "127.0.0.1", 0, fingerprint=dst_layout.fingerprint,
                rows_fingerprint=dst_layout.rows_fingerprint, num_layers=self.layers, compat=self.config.compat,
                landing=self.landing, tp_size=1))
            self.target = f"127.0.0.1:{self.server.port}"
            self.loader = Loader(dst_geometry, self.dst_ops)
            dst_links = self._closing(PeerLinks(self.config, f"bench-lw{tag}-c", None))
            paths = self._closing(PullPaths("tcp", f"bench-lw{tag}-c", 0, dst_geometry, self.loader,
                                            self.results.record, True))
            resliced = self._closing(ReslicedReads(dst_layout, self.config, dst_links, paths, self.loader,
                                                   self.results.record))
            self.reader = LandedReader(self.dst, self.landing.entries, dst_layout, self.config, self.loader,
                                       resliced, self.results.record)
        except BaseException:
            self._stack.close()
            raise

    def _closing(self, part: Any) -> Any:
        self._stack.callback(part.close)  # LIFO: what was made last closes first
        return part

    def book(self, name: str, link_bytes_per_s: float | None) -> Any:
        """The producer's StagingBook for one (emulated) link, made once; closed with the rig."""
        if name not in self.books:
            from kvconnectors.tiered.staging import StagingBook
            from kvconnectors.transport.paths import TCP_PUSH

            self.books[name] = self._closing(StagingBook(
                self.src, self.stager, self.src_ops, self.layout, self.config, self.src_server, self.failures,
                self.results.record, self.links, push_path=TCP_PUSH, row_layout=self.row_layout,
                link_bytes_per_s=link_bytes_per_s))
        return self.books[name]

    def close(self) -> None:
        self._stack.close()


def compute_only(layers: int, layer_s: float) -> float:
    t0 = time.perf_counter()
    for layer in range(layers):
        _sleep_until(t0 + (layer + 1) * layer_s)
    return time.perf_counter() - t0


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def push_prompt(rig: Rig, book: Any, kv: Payload, blocks: int, layer_s: float, group: int | None,
                check: bool = False) -> dict[str, Any]:
    """One prompt through the connector's push path. Producer: per layer, compute (a sleep), then
    save_kv_layer's hand-off (StagingBook.save_layer: the staging thread has the Stager copy the
    layer's blocks into the store and checksums them; layer-wise, with `group` set, its PushBook sends
    every full group of layers; at the last layer it seals and sends the last group, sealing the
    landing copy); then wait_for_save. Bulk (`group` None): the same with the request's layerwise
    flag off, so every layer goes in that one last message. Consumer: the LandedReader waits for the
    seal and copies the blocks into its KV cache. Returns timestamps relative to prefill start (s)."""
    from kvconnectors.tiered import params as kvparams
    from kvconnectors.tiered.load import Load
    from kvconnectors.tiered.metadata import RecvSpec, SaveSpec, TieredConnectorMetadata

    assert group is None or group == rig.group, f"this rig pushes {rig.group} layers per group"
    layers = rig.layers
    tid, token = f"lw-{secrets.token_hex(6)}", secrets.token_hex(8)
    if check:
        kv.prepare_check(blocks)
    sids, dids = kv.src_ids[:blocks].tolist(), kv.dst_ids[:blocks].tolist()
    meta = TieredConnectorMetadata(saves=[SaveSpec("bench", tid, sids, 0, blocks, True, push_target=rig.target,
                                                   layerwise=group is not None, token=token)])
    ticket = kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id=tid, addrs=[kvparams.PeerAddress("127.0.0.1", rig.src_server.port)],
        num_tokens=blocks, num_blocks=blocks, block_size=1, fingerprint=rig.layout.fingerprint, prompt_hash="bench",
        lease_ttl_s=600, issued_at=0, token=token, tp_size=1, kv_heads=rig.layout.kv_heads, push_target=rig.target)
    load = Load(RecvSpec("bench", None, dids, 0), ticket, dids, None)
    sender = book.pushes.sender
    pushes0, bytes0 = sender.pushes, sender.bytes_pushed
    loaded = False
    t0 = time.perf_counter()
    try:
        t_compute = 0.0
        for layer in range(layers):
            if layer_s > 0:
                _sleep_until(t0 + (layer + 1) * layer_s)
            t_compute = time.perf_counter() - t0  # the layer's compute ended; its staging starts
            book.save_layer(meta, layer)
        book.wait_for_save(meta)  # every staged byte is in the producer store, the entry sealed
        t_sealed = time.perf_counter() - t0
        now = time.monotonic()
        rig.landing.entries.wait(tid, now + TIMEOUT_S, now + TIMEOUT_S)
        t_landed = time.perf_counter() - t0
        rig.reader.load(load, time.monotonic() + TIMEOUT_S)  # read_into a host buffer, Loader into the blocks
        t_end = time.perf_counter() - t0
        loaded = True
    finally:
        if not loaded:  # as an aborted request: the producer's staging and pushes end, the landed copy goes
            book.drop(tid)
            rig.reader.free([tid])
        if not sender.flush(TIMEOUT_S):
            raise TimeoutError(f"push of {tid} did not finish within {TIMEOUT_S:.0f} s")
    if tid in rig.failures:
        raise RuntimeError(f"push of {tid} failed: {rig.failures.get(tid)}")
    if check:
        kv.check(blocks)
    return {"ttft_s": t_end, "compute_s": t_compute, "sealed_s": t_sealed, "landed_s": t_landed,
            "copy_s": t_end - t_landed, "pushes": sender.pushes - pushes0,
            "bytes_pushed": sender.bytes_pushed - bytes0, "verified": check}


# ============================================================================== driver
def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def run_layerwise(preset: str = "8b", tokens: int = 2000, block_tokens: int = 16, group: int = 4,
                  links: str | Sequence[str] = "all", gpu: str = "h100-sxm", mfu: float | None = None,
                  layers: int | None = None, time_scale: float | None = None, byte_scale: float | None = None,
                  link_headroom: float = 3.0, reps: int = 5,
                  short_tokens: str | Sequence[int] | None = DEFAULT_SHORT_TOKENS, short_reps: int = 11,
                  short_us_per_token: float | str = 0.0, crossover_tolerance: float = 0.05,
                  out: str | None = None, seed: int = 0,
                  show_progress: bool = True, quiet: bool = False, results_dir: str | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables (unless quiet); write JSON + PNG; return the result dict."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(MODEL_PRESETS)}")
    if gpu not in planner.GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; choose from {', '.join(planner.GPUS)}")
    model = planner.MODELS[MODEL_PRESETS[preset]]
    mfu = planner.Workload().mfu if mfu is None else mfu
    layers = model.layers if layers is None else layers
    if tokens < 1 or block_tokens < 1 or reps < 1 or short_reps < 1 or not 1 <= group:
        raise ValueError("tokens, block-tokens, group, reps and short-reps must be >= 1")
    if not 1 <= layers <= model.layers:
        raise ValueError(f"layers must be in [1, {model.layers}] (the {preset} model has {model.layers})")
    if group > layers:
        raise ValueError(f"group {group} is larger than the {layers} layers")
    if not 0 < mfu <= 1 or link_headroom < 1:
        raise ValueError("mfu must be in (0, 1] and link-headroom >= 1")
    if time_scale is not None and time_scale < 1 or byte_scale is not None and byte_scale < 1:
        raise ValueError("time-scale and byte-scale must be >= 1")
    link_specs = parse_links(links)
    shorts = parse_tokens(short_tokens) if short_tokens is not None else []
    cal = Calibration(preset, model, planner.GPUS[gpu], mfu, tokens, block_tokens, layers, group)
    if short_us_per_token == "calibrated":
        short_us = cal.s_per_token * 1e6
    else:
        short_us = float(short_us_per_token)
        if short_us < 0:
            raise ValueError("short-us-per-token must be >= 0 (or 'calibrated')")
    S = float(time_scale) if time_scale is not None else max(1.0, float(round(LAYER_TARGET_S / cal.layer_compute_s)))

    t_start = time.perf_counter()
    n_groups = math.ceil(layers / group)
    probe_blocks = max(1, min(cal.blocks, round(PROBE_BYTES / (layers * cal.slot_bytes))))
    short_blocks = max([math.ceil(n / block_tokens) for n in shorts], default=0)
    probe_reps = 3
    total = (probe_reps + 1 + 2 * len(shorts) * short_reps + len(link_specs) + 1 + reps * (2 + 2 * len(link_specs)))
    bar = progress(total, f"layerwise {preset} {tokens} tok", show_progress)
    result: dict[str, Any] = {"benchmark": "layerwise"}
    errors: list[str] = []
    try:
        # ---------------------------------------------------- 1. loopback probe + short prompts (real slots)
        kv = Payload(layers, max(probe_blocks, short_blocks), cal.slot_bytes, seed)
        rig = Rig(kv, group, 1.25, tag="r")
        try:
            book = rig.book("loopback", None)
            bar.set_postfix_str("loopback probe")
            probe_runs = []
            for r in range(probe_reps + 1):  # the first one warms up (connection) and verifies
                run = push_prompt(rig, book, kv, probe_blocks, 0.0, None, check=r == 0)
                if r:
                    probe_runs.append(run)
                bar.update(1)
            probe_bytes = layers * probe_blocks * cal.slot_bytes
            probe_s = [x["landed_s"] - x["sealed_s"] for x in probe_runs]  # sealed: the push was submitted
            loopback_bps = probe_bytes / float(np.median(probe_s))
            result["loopback"] = {"bytes": probe_bytes, "times_s": probe_s, "bytes_per_s": loopback_bps,
                                  "what": ("one unpaced bulk push: wait_for_save returned (the last layer staged, "
                                           "the entry sealed, its push submitted) -> sealed on the landing side")}
            result["short_prompts"] = _short_section(rig, book, kv, shorts, short_reps, short_us, cal, bar,
                                                     crossover_tolerance)
        finally:
            del kv
            rig.close()

        # ---------------------------------------------------- 2. emulated links (scaled slots and time)
        fastest = max((lk.bytes_per_s for lk in link_specs), default=loopback_bps)
        if byte_scale is None:
            need = link_headroom * fastest / (S * loopback_bps)
            D_req = 2 ** max(0, math.ceil(math.log2(max(need, 1.0))))
        else:
            D_req = byte_scale
        slot_e = max(min(MIN_EMULATED_SLOT, cal.slot_bytes), int(cal.slot_bytes // D_req))
        D = cal.slot_bytes / slot_e
        notes = []
        if D < D_req:
            notes.append(f"byte scale capped at {D:g} (slots of at least {slot_e} B): the fastest emulated "
                         f"link is above 1/{link_headroom:g} of loopback")
        scaling = {"time_scale": S, "byte_scale": D, "byte_scale_requested": D_req, "link_headroom": link_headroom,
                   "slot_bytes_emulated": slot_e, "layer_bytes_emulated": cal.blocks * slot_e,
                   "total_bytes_emulated": layers * cal.blocks * slot_e,
                   "layer_compute_s_emulated": cal.layer_compute_s * S,
                   "fastest_link_vs_loopback": fastest / (S * D) / loopback_bps, "notes": notes}
        result["scaling"] = scaling
        layer_s = cal.layer_compute_s * S
        kv = Payload(layers, cal.blocks, slot_e, seed + 1)
        rig = Rig(kv, group, 3, tag="e")
        try:
            runs: dict[str, dict[str, list]] = {lk.name: {"bulk": [], "layerwise": []} for lk in link_specs}
            status: dict[str, dict[str, Any]] = {lk.name: {"status": "ok", "reason": None, "verified": False}
                                                 for lk in link_specs}
            # The control: the same layer-wise pipeline with no link emulation (loopback, unpaced). What
            # it adds to the prefill is the connector's software tail, which no link speed removes.
            bar.set_postfix_str("instant link warm-up")
            push_prompt(rig, rig.book(INSTANT, None), kv, 1, 0.0, group)
            bar.update(1)
            instant: list[dict[str, Any]] = []
            for link in link_specs:  # one staging book per link (its pacing rate is fixed); connect untimed
                bar.set_postfix_str(f"{link.name} warm-up")
                try:
                    push_prompt(rig, rig.book(link.name, link.bytes_per_s / (S * D)), kv, 1, 0.0, group)
                except Exception as exc:
                    status[link.name].update(status="failed", reason=_describe(exc))
                    errors.append(f"{link.name}: {_describe(exc)}")
                bar.update(1)
            prefill_alone: list[float] = []
            for r in range(reps):
                bar.set_postfix_str("prefill alone")
                prefill_alone.append(compute_only(layers, layer_s))
                bar.update(1)
                bar.set_postfix_str("instant link layerwise")
                instant.append({**push_prompt(rig, rig.books[INSTANT], kv, cal.blocks, layer_s, group,
                                              check=r == 0), "rep": r})
                bar.update(1)
                k = r % max(1, len(link_specs))
                for link in link_specs[k:] + link_specs[:k]:
                    modes = ("bulk", "layerwise") if r % 2 == 0 else ("layerwise", "bulk")
                    for mode in modes:
                        bar.set_postfix_str(f"{link.name} {mode}")
                        if status[link.name]["status"] == "ok":
                            try:
                                x = push_prompt(rig, rig.books[link.name], kv, cal.blocks, layer_s,
                                                group if mode == "layerwise" else None, check=r == 0)
                                runs[link.name][mode].append({**x, "rep": r})
                            except Exception as exc:
                                status[link.name].update(status="failed", reason=f"{mode}: {_describe(exc)}")
                                errors.append(f"{link.name} {mode}: {_describe(exc)}")
                        bar.update(1)
                if r == 0:
                    for link in link_specs:
                        status[link.name]["verified"] = status[link.name]["status"] == "ok"
        finally:
            rig.close()
    finally:
        bar.close()

    result.update(_link_results(cal, S, D, link_specs, runs, status, prefill_alone, instant))
    result["config"] = {**cal.describe(), "time_scale": S, "byte_scale": D, "reps": reps,
                        "short_reps": short_reps, "seed": seed, "links": [lk.name for lk in link_specs],
                        "n_groups": n_groups, "checksum": True, "transport": "tcp loopback (inline push)",
                        "target_overhead_groups": TARGET_OVERHEAD_GROUPS,
                        "target_max_plus_group": TARGET_MAX_PLUS_GROUP}
    result["host"] = host_info()
    result["errors"] = errors
    result["wall_s"] = time.perf_counter() - t_start
    return publish(result, out, f"layerwise_{preset}_{tokens}tok_g{group}", _plot, render, quiet, results_dir)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _short_section(rig: Rig, book: Any, kv: Payload, shorts: list[int], reps: int, us_per_token: float,
                   cal: Calibration, bar: Any, tolerance: float) -> dict[str, Any]:
    layers = rig.layers
    rows = []
    for n in shorts:
        blocks = math.ceil(n / cal.block_tokens)
        layer_s = n * us_per_token * 1e-6 / cal.model.layers
        times: dict[str, list[dict]] = {"bulk": [], "layerwise": []}
        for r in range(reps):
            for mode in (("bulk", "layerwise") if r % 2 == 0 else ("layerwise", "bulk")):
                bar.set_postfix_str(f"short {n} tok {mode}")
                times[mode].append(push_prompt(rig, book, kv, blocks, layer_s,
                                               cal.group if mode == "layerwise" else None, check=r == 0))
                bar.update(1)
        b = _median([x["ttft_s"] for x in times["bulk"]])
        w = _median([x["ttft_s"] for x in times["layerwise"]])
        paired = [x["ttft_s"] / y["ttft_s"] for x, y in zip(times["layerwise"], times["bulk"])]
        rows.append({"tokens": n, "blocks": blocks, "bytes": layers * blocks * cal.slot_bytes,
                     "prefill_s": layers * layer_s, "bulk_s": b, "layerwise_s": w, "delta_s": w - b,
                     "ratio": _median(paired), "pushes": {m: times[m][0]["pushes"] for m in times},
                     "copy_s": _median([x["copy_s"] for x in times["bulk"] + times["layerwise"]]),
                     "bulk_times_s": [x["ttft_s"] for x in times["bulk"]],
                     "layerwise_times_s": [x["ttft_s"] for x in times["layerwise"]],
                     "verified": all(x["verified"] for x in (times["bulk"][0], times["layerwise"][0]))})
    crossover = None
    for i in range(len(rows)):
        if all(r["ratio"] <= 1 + tolerance for r in rows[i:]):
            crossover = rows[i]["tokens"]
            break
    return {"us_per_token": us_per_token, "reps": reps, "group": cal.group, "slot_bytes": cal.slot_bytes,
            "rows": rows, "crossover_tokens": crossover, "crossover_tolerance": tolerance,
            "crossover_rule": (f"shortest prompt from which layer-wise TTFT <= (1 + {tolerance:g}) x bulk TTFT at "
                               "every measured length (median of the per-repetition layer-wise / bulk ratios; "
                               "the two modes run back to back in each repetition)"),
            "configured_layerwise_min_tokens": default_min_tokens()}


def _link_results(cal: Calibration, S: float, D: float, link_specs: list[planner.LinkSpec],
                  runs: dict[str, dict[str, list]], status: dict[str, dict], prefill_alone: list[float],
                  instant: list[dict[str, Any]]) -> dict[str, Any]:
    P = _median(prefill_alone)
    lw0 = _median([x["ttft_s"] for x in instant])
    tail = lw0 - P if lw0 is not None and P is not None else None  # the software tail, real time
    layers, group = cal.layers, cal.group
    frac = group / layers
    out_links: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for link in link_specs:
        rate_e = link.bytes_per_s / (S * D)
        X = cal.total_bytes / link.bytes_per_s * S        # = emulated bytes / emulated rate
        Xg = X * frac
        s = {**status[link.name], "gbps": link.gbps, "rate_bytes_per_s": link.bytes_per_s,
             "rate_bytes_per_s_emulated": rate_e}
        r = runs[link.name]
        bulk = _median([x["ttft_s"] for x in r["bulk"]])
        lw = _median([x["ttft_s"] for x in r["layerwise"]])
        em: dict[str, Any] = {"prefill_alone": P, "transfer": X, "one_group": Xg,
                              "transfer_per_layer": X / layers, "compute_per_layer": cal.layer_compute_s * S,
                              "bulk": bulk, "layerwise": lw,
                              "pipeline_model": max(P + Xg, X + P * frac) if P is not None else None,
                              "bulk_model": P + X if P is not None else None,
                              "copy": _median([x["copy_s"] for x in r["bulk"] + r["layerwise"]]),
                              "compute_during_layerwise": _median([x["compute_s"] for x in r["layerwise"]]),
                              "software_tail": tail}
        link_bound = X > cal.layer_compute_s * S * layers
        if lw is not None and bulk is not None and P is not None:
            m = max(P, X)
            em["overhead"] = lw - m
            em["saved_vs_bulk"] = bulk - lw
            s["overhead_groups"] = (lw - m) / Xg
            s["layerwise_vs_max_plus_group"] = lw / (m + Xg)
            s["bulk_vs_max_plus_group"] = bulk / (m + Xg)
            s["bulk_vs_sum"] = bulk / (P + X)
            # What the link adds beyond the instant-link control, paired within each repetition (the
            # two runs of a pair share the drift of this host): layer-wise TTFT(link) - TTFT(instant)
            # - (max(P, X) - P). Issue #3's target is on this: the transfer's own overhead.
            base = {x["rep"]: x["ttft_s"] for x in instant}
            exposed = _median([x["ttft_s"] - base[x["rep"]] - (m - P) for x in r["layerwise"] if x["rep"] in base])
            if exposed is not None:
                em["transfer_exposed"] = exposed
                s["transfer_exposed_groups"] = exposed / Xg
                s["met_overhead"] = s["transfer_exposed_groups"] <= TARGET_OVERHEAD_GROUPS
            s["met_max_plus_group"] = (s["layerwise_vs_max_plus_group"] <= TARGET_MAX_PLUS_GROUP) if link_bound else None
        s["link_bound"] = link_bound
        s["emulated_s"] = em
        s["real_ms"] = {k: (v / S * 1e3 if v is not None else None) for k, v in em.items()}
        s["runs"] = r
        out_links[link.name] = s
        targets.append({"link": link.name, "link_bound": link_bound, "overhead_groups": s.get("overhead_groups"),
                        "transfer_exposed_groups": s.get("transfer_exposed_groups"),
                        "met_overhead": s.get("met_overhead"),
                        "met_max_plus_group": s.get("met_max_plus_group")})
    control = {"what": "the same layer-wise pipeline and compute with no link emulation (loopback, unpaced): "
                       "TTFT minus the prefill alone is the connector's software tail after the last layer "
                       "(staging it, sealing, the last Push round trip, the landing check, the consumer's copy)",
               "ttft_s": lw0, "software_tail_s": tail, "copy_s": _median([x["copy_s"] for x in instant]),
               "runs": instant}
    return {"prefill_alone_s": prefill_alone, "instant_link": control, "links": out_links, "targets": targets}


# ============================================================================== output
def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def render(result: dict[str, Any]) -> str:
    c, sc, lb = result["config"], result["scaling"], result["loopback"]
    S = c["time_scale"]
    head = [
        f"layerwise: preset {c['preset']} ({c['model']}, {c['layers']} layers"
        + (f" of {c['model_layers']}" if c["layers"] != c["model_layers"] else "")
        + f", {c['kv_bytes_per_token'] // 1024} KiB/token), {c['tokens']} tokens = {c['blocks']} blocks of "
          f"{c['block_tokens']}, groups of {c['group']} layers ({c['n_groups']} messages layer-wise)",
        f"calibration: {c['gpu']} {c['gpu_peak_tflops']:g} TFLOP/s x MFU {c['mfu']:g} -> {c['us_per_token']:.1f} "
        f"us/token: prefill {c['prefill_ms']:.1f} ms = {c['layer_compute_ms']:.2f} ms/layer; KV "
        f"{c['layer_bytes'] / 2**20:.2f} MiB/layer, {c['total_bytes'] / 2**20:.1f} MiB in all",
        f"scaling: time x{S:g} (one emulated layer computes {sc['layer_compute_s_emulated'] * 1e3:.1f} ms), bytes "
        f"/{c['byte_scale']:g} (slot {c['slot_bytes']} -> {sc['slot_bytes_emulated']} B, "
        f"{sc['total_bytes_emulated'] / 2**20:.2f} MiB per prompt); loopback push path "
        f"{lb['bytes_per_s'] / 1e9:.2f} GB/s unpaced, fastest emulated link at "
        f"{sc['fastest_link_vs_loopback']:.2f} of it",
        f"{c['reps']} repetitions (median); checksums on; TTFT includes the consumer's copy out of the "
        f"landing store. Times in real ms (= emulated / {S:g}).",
    ] + [f"note: {n}" for n in sc["notes"]]
    rows1, rows2 = [], []
    for name, s in result["links"].items():
        ms, em = s["real_ms"], s["emulated_s"]
        if s["status"] != "ok":
            rows1.append([name, s["gbps"], None, None, None, None, None, None, None, "-", s["verified"]])
            rows2.append([name, "-", None, None, None, None, "-", None, None, "-", f"FAILED: {s['reason']}"])
            continue
        rows1.append([name, s["gbps"], ms["transfer"], ms["one_group"], ms["prefill_alone"], ms["bulk"],
                      ms["layerwise"], ms["pipeline_model"], ms["saved_vs_bulk"],
                      f"{em['prefill_alone']:.2f} / {em['bulk']:.2f} / {em['layerwise']:.2f}", s["verified"]])
        rows2.append([name, f"{ms['transfer_per_layer']:.2f} {'>' if s['link_bound'] else '<='} "
                            f"{ms['compute_per_layer']:.2f}",
                      ms["overhead"], s["overhead_groups"], ms.get("transfer_exposed"),
                      s.get("transfer_exposed_groups"), _verdict(s.get("met_overhead")),
                      s["layerwise_vs_max_plus_group"] if s["link_bound"] else None,
                      s["bulk_vs_max_plus_group"] if s["link_bound"] else None,
                      _verdict(s.get("met_max_plus_group")), ""])
    t1 = table(["link", "Gb/s", "transfer", "1 group", "prefill alone", "bulk TTFT", "layer-wise TTFT",
                "pipeline model", "saved", "emulated s (P / bulk / lw)", "verified"], rows1, align="lrrrrrrrrrl")
    t2 = table(["link", "ms/layer xfer vs compute", "overhead", "/ 1 group", "transfer's", "/ 1 group",
                f"<= {TARGET_OVERHEAD_GROUPS}", "lw/(max+grp)", "bulk/(max+grp)", f"lw <= {TARGET_MAX_PLUS_GROUP}x", "note"],
               rows2, align="lrrrrrlrrll")
    ctl = result.get("instant_link") or {}
    tail = ctl.get("software_tail_s")
    tail_line = ("" if tail is None else
                 f"software tail (control: the same layer-wise run with no link emulation; TTFT - prefill alone): "
                 f"{tail * 1e3:.2f} ms on this host, of which the consumer's copy {ctl['copy_s'] * 1e3:.2f} ms; "
                 f"{tail / S * 1e3:.3f} real ms as scaled in the overheads above (host time does not scale). It does not "
                 "depend on the link: where a group carries for less than it (NVLink), it dominates the overhead")
    if not rows1:
        out = head
    else:
        out = head + ["", "TTFT, real ms (transfer / 1 group: the emulated link's nominal time; pipeline model: "
                          "max(P + 1 group, X + P x group/layers))", t1, "",
                      "targets: overhead = layer-wise TTFT - max(prefill, transfer), in real ms and in groups; it is "
                      "the connector's software tail (the control below) + the transfer's own overhead on the "
                      "critical path = TTFT(link) - TTFT(instant link) - (max - prefill), paired per repetition; "
                      f"issue #3: the transfer's overhead <= {TARGET_OVERHEAD_GROUPS} groups; where transfer > "
                      "compute, layer-wise ~ max + 1 group, not the sum", t2] + ([tail_line] if tail_line else [])
    sp = result.get("short_prompts")
    if sp and sp["rows"]:
        rows3 = [[r["tokens"], r["blocks"], r["bytes"] / 2**20, r["prefill_s"] * 1e3, r["bulk_s"] * 1e3,
                  r["layerwise_s"] * 1e3, r["delta_s"] * 1e3, r["ratio"], f"{r['pushes']['bulk']} / "
                  f"{r['pushes']['layerwise']}", r["verified"]] for r in sp["rows"]]
        t3 = table(["tokens", "blocks", "MiB", "compute ms", "bulk ms", "layer-wise ms", "lw - bulk ms",
                    "lw / bulk (paired)", "messages b/lw", "verified"], rows3, align="rrrrrrrrrl")
        cross = sp["crossover_tokens"]
        cfg = sp["configured_layerwise_min_tokens"]
        out += ["", f"short prompts: no link emulation (loopback, real {sp['slot_bytes'] // 1024} KiB slots), compute "
                    f"{sp['us_per_token']:g} us/token, group {sp['group']}, {sp['reps']} repetitions (median)", t3,
                ("crossover: " + (f"none in the lengths measured (layer-wise stays more than "
                                  f"{sp['crossover_tolerance']:.0%} slower than bulk)" if cross is None else
                                  f"from {cross} tokens on, layer-wise TTFT stays within "
                                  f"{sp['crossover_tolerance']:.0%} of bulk (per-group overhead no longer matters)")
                 + f"; the connector's layerwise_min_tokens default is {cfg}")]
    if result.get("errors"):
        out += ["", "errors:"] + [f"  {e}" for e in result["errors"]]
    files = result.get("files", {})
    if files:
        out += ["", f"JSON {files.get('json')}", f"PNG  {files.get('png')}"]
    return "\n".join(out)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["config"]
    sp = result.get("short_prompts") or {}
    has_short = bool(sp.get("rows"))
    ok = [(n, s) for n, s in result["links"].items() if s["status"] == "ok"]
    panels = (["links"] if ok else []) + (["short"] if has_short else [])
    if not panels:
        return
    width = 8 * bool(ok) + 5 * has_short
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 5), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if len(panels) == 2 else None)
    if ok:
        _plot_links(axes[0][0], result, ok, c)
    if has_short:
        _plot_short(axes[0][-1], sp)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_links(ax: Any, result: dict[str, Any], ok: list, c: dict[str, Any]) -> None:
    x = np.arange(len(ok))
    w = 0.27
    for i, (label, key) in enumerate((("prefill alone", "prefill_alone"), ("bulk", "bulk"),
                                      ("layer-wise", "layerwise"))):
        vals = [s["real_ms"][key] for _, s in ok]
        bars = ax.bar(x + (i - 1) * w, vals, w, label=label, color=MODE_COLOR[label], edgecolor="black",
                      linewidth=0.5)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
    for j, (_, s) in enumerate(ok):  # the pipeline model as a tick over the layer-wise bar
        ax.plot([j + w / 2, j + 3 * w / 2], [s["real_ms"]["pipeline_model"]] * 2, color="black", lw=1.2, ls="--")
    ax.set_xticks(x, [f"{n}\n{s['gbps']:g} Gb/s" + ("\n(transfer > compute)" if s["link_bound"] else "")
                      for n, s in ok], fontsize=8)
    ax.set_ylabel("TTFT, real ms (median)")
    ax.set_title(f"{c['preset']}, {c['tokens']} tokens, {c['layers']} layers in groups of {c['group']}, "
                 f"emulated x{c['time_scale']:g} time, /{c['byte_scale']:g} bytes", fontsize=9)
    top = max([max(s["real_ms"]["bulk"], s["real_ms"]["layerwise"]) for _, s in ok], default=1.0)
    ax.set_ylim(0, top * 1.35)  # room for the notes
    ax.plot([], [], color="black", ls="--", lw=1.2, label="pipeline model")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    notes = [f"{t['link']}: transfer's overhead {t['transfer_exposed_groups']:.2f} groups "
             f"({_verdict(t['met_overhead'])}), with the software tail {t['overhead_groups']:.2f}"
             for t in result["targets"] if t.get("transfer_exposed_groups") is not None]
    if notes:
        ax.text(0.99, 0.98, "\n".join(notes) + f"\ntarget <= {TARGET_OVERHEAD_GROUPS} groups", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, family="monospace")


def _plot_short(ax: Any, sp: dict[str, Any]) -> None:
    """The paired layer-wise / bulk TTFT ratio over prompt length, each point labelled with lw - bulk."""
    t = [r["tokens"] for r in sp["rows"]]
    ratios = [r["ratio"] for r in sp["rows"]]
    ax.plot(t, ratios, "s-", color=MODE_COLOR["layer-wise"], label="layer-wise / bulk TTFT")
    for x, y, r in zip(t, ratios, sp["rows"]):
        ax.annotate(f"{r['delta_s'] * 1e3:+.1f} ms", (x, y), ha="center", va="bottom", fontsize=6,
                    xytext=(0, 3), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1 + sp["crossover_tolerance"], color="grey", ls=":", lw=0.8,
               label=f"+{sp['crossover_tolerance']:.0%} tolerance")
    if sp.get("crossover_tokens"):
        ax.axvline(sp["crossover_tokens"], color="green", ls=":", label=f"crossover {sp['crossover_tokens']} tok")
    if sp.get("configured_layerwise_min_tokens"):
        ax.axvline(sp["configured_layerwise_min_tokens"], color="black", ls="--", lw=0.8,
                   label=f"layerwise_min_tokens {sp['configured_layerwise_min_tokens']}")
    ax.set_xscale("log", base=2)
    ax.margins(x=0.08, y=0.12)
    ax.set_xticks(t, [str(v) for v in t], fontsize=7)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("layer-wise / bulk TTFT (median of paired runs)")
    ax.set_title(f"short prompts on loopback, compute {sp['us_per_token']:g} us/token\n"
                 f"(labels: layer-wise - bulk, median)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")


# ============================================================================== command line
def _auto(kind: type):
    """A number, or 'auto' / 'all' for None (the benchmark picks)."""
    def parse(text: str):
        if text in ("auto", "all"):
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def _short_us(text: str) -> float | str:
    if text == "calibrated":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected microseconds per token or 'calibrated'") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="8b",
                        help="model (kvconnectors.planner presets): 8b = llama-8b, 32 layers, 128 KiB/token; "
                             "70b = llama-70b GQA, 80 layers, 320 KiB/token")
    parser.add_argument("--tokens", type=int, default=2000, help="prompt tokens (sets compute and KV bytes)")
    parser.add_argument("--block-tokens", type=int, default=16,
                        help="tokens per KV block; one (layer, block) slot is the unit staged, checksummed, pushed")
    parser.add_argument("--group", type=int, default=4,
                        help="layers per push message in layer-wise mode (the connector's layer_group_size)")
    parser.add_argument("--links", default="all",
                        help=f"comma-separated links: {', '.join(f'{k} ({v.gbps:g} Gb/s)' for k, v in planner.LINKS.items())}"
                             ", 'all', NAME=GBIT for another line rate in Gbit/s, or 'none' (short prompts only)")
    parser.add_argument("--gpu", choices=sorted(planner.GPUS), default="h100-sxm",
                        help="GPU whose dense bf16 peak calibrates the per-layer compute")
    parser.add_argument("--mfu", type=float, default=planner.Workload().mfu,
                        help="fraction of the GPU's peak the prefill achieves")
    parser.add_argument("--layers", type=_auto(int), default="all",
                        help="emulate only the first N layers of the model (same per-layer cost and bytes; quick "
                             "runs); 'all' = the model's")
    parser.add_argument("--time-scale", type=_auto(float), default="auto",
                        help="S: emulated time = S x real time; auto = one emulated layer computes ~25 ms")
    parser.add_argument("--byte-scale", type=_auto(float), default="auto",
                        help="D: emulated bytes = real bytes / D, link rates / (S x D); auto = the smallest power "
                             "of two that keeps the fastest link <= loopback / --link-headroom")
    parser.add_argument("--link-headroom", type=float, default=3.0,
                        help="the auto byte scale keeps every emulated link this many times below the measured "
                             "loopback rate of the push path")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per link and mode (median reported)")
    parser.add_argument("--short-tokens", default=",".join(map(str, DEFAULT_SHORT_TOKENS)),
                        help="prompt lengths of the short-prompt section (comma-separated; 'none' skips it)")
    parser.add_argument("--short-reps", type=int, default=11, help="repetitions per short-prompt length and mode")
    parser.add_argument("--short-us-per-token", type=_short_us, default=0.0,
                        help="compute per prompt token in the short-prompt section, real microseconds; 0 = none "
                             "(the worst case for layer-wise), 'calibrated' = the preset's GPU/MFU cost")
    parser.add_argument("--crossover-tolerance", type=float, default=0.05,
                        help="the crossover is the shortest prompt from which layer-wise TTFT stays within this "
                             "fraction of bulk TTFT at every longer measured length")
    parser.add_argument("--no-short", action="store_true", help="skip the short-prompt section")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory for the JSON and PNG")
    parser.add_argument("--seed", type=int, default=0, help="payload and block-table seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_results_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        result = run_layerwise(preset=args.preset, tokens=args.tokens, block_tokens=args.block_tokens,
                               group=args.group, links=args.links, gpu=args.gpu, mfu=args.mfu, layers=args.layers,
                               time_scale=args.time_scale, byte_scale=args.byte_scale,
                               link_headroom=args.link_headroom, reps=args.reps,
                               short_tokens=None if args.no_short else args.short_tokens,
                               short_reps=args.short_reps, short_us_per_token=args.short_us_per_token,
                               crossover_tolerance=args.crossover_tolerance,
                               out=args.out, seed=args.seed, show_progress=not args.no_progress,
                               results_dir=args.results_dir)
    except ValueError as exc:
        print(f"kvconnectors bench layerwise: {exc}", file=sys.stderr)
        return 2
    ok = all(s["status"] == "ok" and s["verified"] for s in result["links"].values())
    ok = ok and all(r["verified"] for r in result["short_prompts"]["rows"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return module_main("kvconnectors.benchmarks.layerwise", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
