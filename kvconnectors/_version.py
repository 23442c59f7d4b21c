"""The package version and the vLLM releases it supports: the one place both are written.

setup.py reads this file without importing the package (the build has no vLLM), so it holds
plain literals only.
"""

__version__ = "0.1.0"

# Supported vLLM: VLLM_MIN <= (major, minor) < VLLM_BELOW.
VLLM_MIN = (0, 32)
VLLM_BELOW = (0, 34)
SUPPORTED_VLLM = f">={VLLM_MIN[0]}.{VLLM_MIN[1]},<{VLLM_BELOW[0]}.{VLLM_BELOW[1]}"
