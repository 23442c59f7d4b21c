"""TieredConnector: prefill->decode KV handoff through a staged, leased host store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnectors.tiered.connector import TieredConnector

__all__ = ["TieredConnector"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: the plugin entry point (registry.py) imports
    # kvconnectors.tiered.client_errors in every vLLM process, also those that never use the
    # connector, and must not pull in the connector (torch, the version check) there.
    if name == "TieredConnector":
        from kvconnectors.tiered.connector import TieredConnector

        return TieredConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
