"""kvconnectors: KV-cache connectors, a conformance suite and tooling for vLLM prefill/decode
disaggregation."""

from kvconnectors._version import SUPPORTED_VLLM, __version__

__all__ = ["SUPPORTED_VLLM", "__version__"]
