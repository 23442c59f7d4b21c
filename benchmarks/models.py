"""The model KV shapes the benchmarks move: short preset names over kvconnectors.planner's models (one
source for layers, KV heads, head dim and dtype bytes), and the block arithmetic every benchmark does
with them (a prompt's KV as layers x blocks slots)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvconnectors import planner


@dataclass(frozen=True)
class Preset:
    """A planner model under the benchmarks' short name, with a line saying what it stands for."""
    name: str
    model: planner.ModelSpec
    about: str

    @property
    def num_layers(self) -> int:
        return self.model.layers

    @property
    def token_bytes_per_layer(self) -> int:
        return self.model.kv_bytes_per_token_layer

    @property
    def token_bytes(self) -> int:
        return self.model.kv_bytes_per_token


PRESETS: dict[str, Preset] = {
    "8b": Preset("8b", planner.MODELS["llama-8b"],
                 "Llama-3-8B-like: 32 layers x 8 KV heads x 128, bf16 (128 KiB/token)"),
    "70b": Preset("70b", planner.MODELS["llama-70b"], "Llama-3-70B-like GQA: 80 layers x 8 KV heads x 128, bf16 "
                                                      "(320 KiB/token)"),
    "tiny": Preset("tiny", planner.MODELS["tiny"], "the project's tiny test model: 2 layers x 2 KV heads x 32, "
                                                   "fp32 (1 KiB/token)"),
}


class KVBlocks:
    """A prompt's KV laid out as num_layers x num_blocks slots of one (layer, block) each. Mixed into a
    frozen dataclass that provides `model` (a planner.ModelSpec), tokens, block_tokens and num_layers
    (the layers that move: a benchmark may emulate fewer than the model has)."""
    model: planner.ModelSpec
    tokens: int
    block_tokens: int
    num_layers: int

    @property
    def token_bytes_per_layer(self) -> int:
        return self.model.kv_bytes_per_token_layer

    @property
    def num_blocks(self) -> int:  # a partial last block still moves whole, as in vLLM
        return math.ceil(self.tokens / self.block_tokens)

    @property
    def slot_bytes(self) -> int:
        return self.token_bytes_per_layer * self.block_tokens

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.num_blocks

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes
