"""Deterministic tiny models with a locally trained byte-level BPE tokenizer.

Nothing is downloaded. The Llama variants (`VARIANTS`) are written by hand: weights from a seeded
numpy RNG (independent of transformers' init code, so the bytes only depend on the spec). The
other families (`FAMILY_VARIANTS`, tinyfamilies.py) come from transformers' config classes and
init code under a fixed torch seed. Every variant uses the same tokenizer, trained on a synthetic
corpus. Models are cached under `$KVCONNECTORS_CACHE/models/<variant>-<spec hash>`.

Constraints found on vLLM's CPU backend: head_dim >= 32 (CPU attention kernels), a large
initializer range (0.2) so greedy argmax is stable, fp32 by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvconnectors.testing.tinyfamilies import FAMILY_VARIANTS, FamilySpec, write_family_model

GENERATOR_VERSION = 1

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 768
    max_position: int = 2048
    dtype: str = "float32"
    initializer_range: float = 0.2
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def content_hash(self) -> str:
        payload = json.dumps({"v": GENERATOR_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# The hand-written Llama variants (benchmarks read their shapes: num_layers, head_dim, ...).
VARIANTS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    # Deeper and longer, for layer-wise transfer and benchmarks.
    "deep": TinyModelSpec(num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2,
                          intermediate_size=512, max_position=4096),
    "tiny-bf16": TinyModelSpec(dtype="bfloat16"),
}

# One line per variant for `kvconnectors make-model --list`.
ABOUT: dict[str, str] = {
    "tiny": "Llama, 2 layers, hidden 128, fp32 (the tests' model)",
    "deep": "Llama, 8 layers, hidden 256, 4k context, fp32 (layer-wise transfer, benchmarks)",
    "tiny-bf16": "Llama, as tiny in bf16",
    "qwen3": "Qwen3: GQA with q/k norm, 2 layers, hidden 128, fp32",
    "mixtral": "Mixtral: MoE (4 experts, top-2), 2 layers, hidden 128, fp32",
    "gemma3": "Gemma3 text: 4 sliding-window (64) + 2 full-attention layers, hidden 256, fp32",
    "granitemoehybrid": "GraniteMoeHybrid: 4 Mamba2 + 2 attention layers, hidden 256, fp32",
    "qwen3_next": "Qwen3-Next: 4 Gated DeltaNet + 2 attention layers, MoE, hidden 256, bf16",
    "deepseek_v2": "DeepseekV2: MLA (latent 512 + rope 64), 4 dense layers, hidden 256, fp32",
}


def known_variants() -> list[str]:
    """Every variant ensure_tiny_model accepts: the Llama ones, then the other families."""
    return [*VARIANTS, *FAMILY_VARIANTS]


def variant_spec(variant: str) -> TinyModelSpec | FamilySpec:
    if variant in VARIANTS:
        return VARIANTS[variant]
    if variant in FAMILY_VARIANTS:
        return FAMILY_VARIANTS[variant]
    raise ValueError(f"unknown tiny model variant {variant!r}; known: {sorted(known_variants())}")


def spec_hash(spec: TinyModelSpec | FamilySpec) -> str:
    """The hash in a variant's directory name (the Llama specs' is their content_hash())."""
    if isinstance(spec, FamilySpec):
        return spec.content_hash(GENERATOR_VERSION)
    return spec.content_hash()


def cache_root() -> Path:
    return Path(os.environ.get("KVCONNECTORS_CACHE", Path.home() / ".cache" / "kvconnectors"))


# ---------------------------------------------------------------- corpus and prompts

_WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are have not "
    "cache block layer token prefill decode transfer server request model store lease tier "
    "memory disk network stream latency bandwidth engine worker scheduler proxy queue batch "
    "river mountain garden window table paper light music story morning evening quiet bright "
    "red green blue small large fast slow early late open close read write send receive "
    "one two three four five six seven eight nine ten hundred thousand"
).split()


def synthetic_text(n_words: int, seed: int) -> str:
    """Deterministic pseudo-English text (also used to build test prompts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = rng.choice(len(_WORDS), size=n_words)
    out, sentence = [], []
    for i, w in enumerate(words):
        sentence.append(_WORDS[w])
        if len(sentence) >= 6 + (i % 7):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def _corpus(seed: int) -> list[str]:
    lines = [synthetic_text(60, seed * 1000 + i) for i in range(400)]
    lines += [f"{i} + {i + 1} = {2 * i + 1}" for i in range(200)]
    return lines


# ---------------------------------------------------------------- writers

def _train_tokenizer(spec: TinyModelSpec | FamilySpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def _write_weights(spec: TinyModelSpec, vocab_size: int, out: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(spec.seed)
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
            p + "mlp.up_proj.weight": (spec.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate_size),
        })
    shapes["lm_head.weight"] = (vocab_size, h)
    dtype = getattr(torch, spec.dtype)
    tensors = {
        name: torch.from_numpy(rng.normal(0.0, spec.initializer_range, shape).astype(np.float32)).to(dtype)
        for name, shape in sorted(shapes.items())
    }
    norms = ["model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(spec.num_layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    tensors.update({n: torch.ones(h, dtype=dtype) for n in norms})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_config(spec: TinyModelSpec, vocab_size: int, bos: int, eos: int, out: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": vocab_size, "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "initializer_range": spec.initializer_range, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))


def generate(spec: TinyModelSpec | FamilySpec, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab_size = max(len(vocab), spec.vocab_size)
    if isinstance(spec, FamilySpec):
        write_family_model(spec, vocab_size, vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|pad|>"], out)
        recorded = {"generator_version": GENERATOR_VERSION, "content_hash": spec_hash(spec),
                    **dataclasses.asdict(spec)}
    else:
        _write_config(spec, vocab_size, vocab["<|bos|>"], vocab["<|eos|>"], out)
        _write_weights(spec, vocab_size, out)
        recorded = {"generator_version": GENERATOR_VERSION, **dataclasses.asdict(spec)}
    (out / "kvconnectors-spec.json").write_text(json.dumps(recorded, indent=2))
    return out


def ensure_tiny_model(variant: str = "tiny", root: Path | None = None) -> Path:
    """Return the path of the cached model `variant`, generating it once (atomically)."""
    spec = variant_spec(variant)
    root = Path(root) if root is not None else cache_root() / "models"
    final = root / f"{variant}-{spec_hash(spec)}"
    if (final / "kvconnectors-spec.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=root))
    try:
        generate(spec, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------- CLI: kvconnectors make-model

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", default="tiny", choices=known_variants(), metavar="VARIANT",
                        help="which model to generate (or find in the cache) and print the path of: "
                             "'tiny' (Llama, 2 layers, the tests' model), 'deep' (Llama, 8 layers, "
                             "4k context), 'tiny-bf16', or another family: "
                             + ", ".join(FAMILY_VARIANTS) + " (see --list)")
    parser.add_argument("--root", type=Path, default=None,
                        help="cache folder (default: $KVCONNECTORS_CACHE/models)")
    parser.add_argument("--list", action="store_true",
                        help="print every variant with its directory name and a line about it, "
                             "then exit without generating anything")


def run(args: argparse.Namespace) -> int:
    if args.list:
        for variant in known_variants():
            print(f"{variant}-{spec_hash(variant_spec(variant))}  {ABOUT[variant]}")
        return 0
    print(ensure_tiny_model(args.variant, args.root))
    return 0
