"""The tiny models of other architecture families (issue #36, item 4; kvconnectors/testing/tinyfamilies.py).

Each family is generated once per module into a temporary root (not the shared cache) and checked:
config.json (model type, architecture, dtype and the family's distinctive fields, which carry the
constraints measured on vLLM 0.32's CPU backend, see tinyfamilies.py), the shared tokenizer,
safetensors weights that load with no missing key, a second generation byte-identical to the
first, a greedy next token that depends on the context, and vLLM's model registry knowing the
architecture (no engine is built). The Llama variants' directory names are pinned: tests, docs
and caches name them. Marker `slow`: about 40 s on the 2-core VM, most of it transformers' reference
(pure PyTorch) kernels of the two hybrids in the context check, and importing torch and vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from kvconnectors import cli
from kvconnectors.testing import tinyfamilies, tinymodel
from kvconnectors.testing.tinyfamilies import FAMILY_VARIANTS
from kvconnectors.testing.tinymodel import ensure_tiny_model, synthetic_text

pytestmark = pytest.mark.slow

FAMILIES = list(FAMILY_VARIANTS)
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"

# variant -> (model_type, architecture, dtype)
EXPECTED = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "float32"),
    "mixtral": ("mixtral", "MixtralForCausalLM", "float32"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", "float32"),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "float32"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "bfloat16"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM", "float32"),
}

# variant -> (a tensor only that family has, its shape)
DISTINCTIVE_TENSOR = {
    "qwen3": ("model.layers.0.self_attn.q_norm.weight", [32]),
    "mixtral": ("model.layers.0.block_sparse_moe.gate.weight", [4, 128]),  # the router over 4 experts
    "gemma3": ("model.layers.0.pre_feedforward_layernorm.weight", [256]),
    "granitemoehybrid": ("model.layers.0.mamba.A_log", [8]),
    "qwen3_next": ("model.layers.0.linear_attn.A_log", [4]),
    "deepseek_v2": ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", [576, 256]),
}

# The Llama variants' directory hashes: byte-for-byte the models of before the families came.
LLAMA_HASHES = {"tiny": "74f1c785a672", "deep": "99d4c2b23777", "tiny-bf16": "59e949141ab1"}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-families")
    return {variant: ensure_tiny_model(variant, root) for variant in [*FAMILIES, "tiny"]}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_every_family_is_listed_and_checked() -> None:
    assert set(EXPECTED) == set(DISTINCTIVE_TENSOR) == set(FAMILIES)
    assert tinymodel.known_variants() == [*LLAMA_HASHES, *FAMILIES]
    assert set(tinymodel.ABOUT) == set(tinymodel.known_variants())


@pytest.mark.parametrize("variant", FAMILIES)
def test_config_names_the_family_and_stays_tiny(variant: str, made: dict[str, Path]) -> None:
    """The generic fields: type, architecture, dtype, a tiny shape, the tokenizer's ids."""
    config = _config(made[variant])
    model_type, architecture, dtype = EXPECTED[variant]
    assert (config["model_type"], config["architectures"], config["dtype"]) == (model_type, [architecture], dtype)
    assert config["hidden_size"] <= 256 and config["num_hidden_layers"] <= 6
    assert config.get("head_dim") is None or config["head_dim"] >= 32  # CPU attention kernels
    assert config["initializer_range"] == tinyfamilies.INITIALIZER_RANGE
    vocab = json.loads((made[variant] / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["vocab_size"] == max(len(vocab), 768)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        vocab["<|bos|>"], vocab["<|eos|>"], vocab["<|pad|>"])
    recorded = json.loads((made[variant] / "kvconnectors-spec.json").read_text())
    assert made[variant].name == f"{variant}-{recorded['content_hash']}"


def test_gemma3_mixes_sliding_and_full_attention(made: dict[str, Path]) -> None:
    config = _config(made["gemma3"])
    assert config["layer_types"] == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
    assert config["sliding_window"] == 64
    assert config["tie_word_embeddings"] is False  # tied, the model only repeats its input token


def test_hybrids_mix_linear_and_full_attention_layers(made: dict[str, Path]) -> None:
    granite, qwen3_next = _config(made["granitemoehybrid"]), _config(made["qwen3_next"])
    for config in (granite, qwen3_next):
        assert config["layer_types"] == [LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL]
    assert (granite["mamba_n_heads"], granite["mamba_d_head"], granite["num_local_experts"]) == (8, 64, 0)
    # vLLM's CPU Gated DeltaNet: bf16 only, and linear head dim 32 is refused (128 runs)
    assert qwen3_next["dtype"] == "bfloat16"
    assert (qwen3_next["linear_key_head_dim"], qwen3_next["linear_value_head_dim"]) == (128, 128)
    assert qwen3_next["num_experts"] > 0  # vLLM's Qwen3-Next wants at least one MoE layer


def test_deepseek_v2_has_a_576_wide_mla_latent_and_dense_layers(made: dict[str, Path]) -> None:
    config = _config(made["deepseek_v2"])
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)  # latent head 576; 80 is refused
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]  # no MoE layer


def test_mixtral_routes_over_few_small_experts(made: dict[str, Path]) -> None:
    config = _config(made["mixtral"])
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)


@pytest.mark.parametrize("variant", FAMILIES)
def test_weights_are_safetensors_of_the_spec_dtype(variant: str, made: dict[str, Path]) -> None:
    import torch
    from safetensors import safe_open

    dtype = getattr(torch, EXPECTED[variant][2])
    with safe_open(str(made[variant] / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            tensor = f.get_tensor(name)
            assert tensor.dtype == dtype, name
            assert bool(torch.isfinite(tensor).all()), name
        name, shape = DISTINCTIVE_TENSOR[variant]
        assert name in names and f.get_slice(name).get_shape() == shape
    assert "lm_head.weight" in names


def test_every_family_uses_the_llama_variants_tokenizer(made: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    llama = (made["tiny"] / "tokenizer.json").read_bytes()
    for variant in FAMILIES:
        assert (made[variant] / "tokenizer.json").read_bytes() == llama, variant
    tok = AutoTokenizer.from_pretrained(made["qwen3"])
    text = "The cache block moves from prefill to decode."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|user|>hi<|end|><|assistant|>"


@pytest.mark.parametrize("variant", FAMILIES)
def test_a_second_generation_is_byte_identical(variant: str, made: dict[str, Path], tmp_path: Path) -> None:
    """Whatever the caller's torch RNG state, which generating leaves as it was."""
    import torch

    torch.manual_seed(12345)
    torch.rand(7)
    state = torch.get_rng_state()
    again = tinymodel.generate(FAMILY_VARIANTS[variant], tmp_path / variant)
    assert _digests(again) == _digests(made[variant])
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("variant", FAMILIES)
def test_the_next_token_depends_on_the_context(variant: str, made: dict[str, Path]) -> None:
    """transformers loads the weights with no missing or unexpected key, and the greedy next token
    after the same 32 tokens changes with the 16 before them: a model whose output ignored its
    KV cache could not show a broken transfer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made[variant])
    model, info = AutoModelForCausalLM.from_pretrained(made[variant], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.tensor([tok(synthetic_text(60, s))["input_ids"][:48] for s in range(4)])
    other = ids.clone()
    other[:, :16] = torch.tensor([tok(synthetic_text(60, 100 + s))["input_ids"][:16] for s in range(4)])
    with torch.no_grad():
        first, second = (model(x).logits.float().argmax(-1)[:, 32:] for x in (ids, other))
    assert (first != second).float().mean() >= 0.2
    assert (first == ids[:, 32:]).float().mean() < 0.5  # not a model that repeats its input token


def test_vllm_registry_knows_every_family() -> None:
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for variant in FAMILIES:
        assert FAMILY_VARIANTS[variant].architecture in supported, variant


def test_transformers_reads_each_config_back_as_its_class(made: dict[str, Path]) -> None:
    """vLLM reads these configs through transformers' AutoConfig (none is in its own config registry)."""
    from transformers import AutoConfig

    for variant in FAMILIES:
        config = AutoConfig.from_pretrained(made[variant])
        assert type(config).__name__ == FAMILY_VARIANTS[variant].config_class, variant


def test_llama_variants_keep_their_directory_names() -> None:
    assert {v: tinymodel.spec_hash(tinymodel.VARIANTS[v]) for v in tinymodel.VARIANTS} == LLAMA_HASHES


def test_a_family_hash_covers_what_makes_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = FAMILY_VARIANTS["gemma3"]
    base = tinymodel.spec_hash(spec)
    changed = [
        dataclasses.replace(spec, config={**spec.config, "sliding_window": 32}),
        dataclasses.replace(spec, dtype="bfloat16"),
        dataclasses.replace(spec, seed=1),
        dataclasses.replace(spec, vocab_size=512),
        dataclasses.replace(spec, architecture="Gemma3ForConditionalGeneration"),
    ]
    hashes = {tinymodel.spec_hash(s) for s in changed}
    assert base not in hashes and len(hashes) == len(changed)
    assert spec.content_hash(tinymodel.GENERATOR_VERSION + 1) != base
    monkeypatch.setattr(tinyfamilies, "FAMILY_GENERATOR_VERSION", tinyfamilies.FAMILY_GENERATOR_VERSION + 1)
    assert tinymodel.spec_hash(spec) != base
    monkeypatch.undo()
    monkeypatch.setattr(tinyfamilies, "transformers_version", lambda: "0.0.0-other")
    assert tinymodel.spec_hash(spec) != base


def test_unknown_variant_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model variant 'llama-70b'") as info:
        ensure_tiny_model("llama-70b", tmp_path)
    for variant in tinymodel.known_variants():
        assert repr(variant) in str(info.value)
    assert not list(tmp_path.iterdir())


def test_make_model_lists_every_variant_without_generating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVCONNECTORS_CACHE", str(tmp_path))
    assert cli.main(["make-model", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [
        f"{v}-{tinymodel.spec_hash(tinymodel.variant_spec(v))}" for v in tinymodel.known_variants()]
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        cli.main(["make-model", "--help"])
    text = capsys.readouterr().out
    for flag in ("--variant", "--root", "--list"):
        assert flag in text
    for variant in FAMILIES:
        assert variant in text
