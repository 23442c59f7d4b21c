"""Test support shipped with the package: the tiny-model generator and vLLM-on-CPU helpers."""
