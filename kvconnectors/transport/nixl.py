"""The `nixl` data path: the consumer READs staged blocks through NIXL (UCX backend) straight from
the producer's DRAM arena into its own KV cache blocks. The control protocol stays ours (Hello /
Read / Release on the store server's socket); only the bytes move through NIXL.

    producer (NixlSource)                          consumer (NixlSink)
    arena registered once at server start          KV cache layers registered once: host caches as DRAM
                                                   at first pull, CUDA caches as VRAM at start-up
                                                   (GPU-direct, nixl_device.py; not run on a GPU yet)
    Read(data_path="nixl") ──▶ pin entry
                          ◀── ReadReply(agent meta, arena base, offsets, checksums)
    progress own worker while the READ runs        add_remote_agent (cached per producer address)
                                                   prep local + remote dlists, make_prepped_xfer,
                                                   transfer, poll check_xfer_state until DONE
                          ◀── Release (or Ack(ok=False) when the READ failed)
    unpin / free the entry

Three modules, calls flowing one way (source and sink use the agent module, never each other):
  nixl_agent.py   NIXL imported on first use, agents made (UCX, STRICT, no progress thread), the
                  descriptor arrays, NIXL errors as TransferErrors, the polling Backoff
  nixl_source.py  NixlSource - the producer's agent: arena registered, worker progressed during a READ
  nixl_sink.py    NixlSink   - the consumer's agent: memory registered, peers cached, READs to DONE
The data path's two ends over these agents are paths/nixl.py; the VRAM decision is nixl_device.py.

The names below are the NIXL transport's face, each defined once in its module; code that patches
one (tests) patches it in the module that defines it.
"""

from kvconnectors.transport.nixl_agent import (INSTALL_HINT, Backoff, agent_config, nixl_import_error, reg_descs,
                                               require_nixl, unique_agent_name, xfer_descs)
from kvconnectors.transport.nixl_sink import MEM_TYPES, NixlSink
from kvconnectors.transport.nixl_source import NixlSource

__all__ = ["INSTALL_HINT", "MEM_TYPES", "Backoff", "NixlSink", "NixlSource", "agent_config", "nixl_import_error",
           "reg_descs", "require_nixl", "unique_agent_name", "xfer_descs"]
