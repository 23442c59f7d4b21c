"""kvconnectors: KV-cache connectors, a conformance suite and tooling for vLLM prefill/decode
disaggregation."""

__version__ = "0.1.0"

SUPPORTED_VLLM = (">=0.32", "<0.34")
