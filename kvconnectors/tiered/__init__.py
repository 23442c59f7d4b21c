"""TieredConnector: prefill->decode KV handoff through a staged, leased host store."""

from kvconnectors.tiered.connector import TieredConnector

__all__ = ["TieredConnector"]
