"""Data paths: how a transfer's bytes travel, one module per medium, each end given what it needs.

Pulls (a consumer reads a staged transfer, `PullPath`):
  tcp.py          TcpPull "inline" - the bytes follow the ReadReply on the control socket
                  (TcpHeadsPull "inline_heads": only some KV heads of each row)
  shm.py          ShmPull "shm"    - the consumer copies them out of the producer's /dev/shm arena
  nixl.py         NixlPull "nixl"  - the consumer READs them through NIXL (UCX) from the producer's arena
  nixl_device.py  NixlDevicePull   - the same READ, straight into device (VRAM) KV blocks (label nixl_vram)
Pushes (a producer streams layer groups into a landing store, `PushPath`):
  tcp.py          TcpPush "inline" - the bytes follow the Push frame
  nixl.py         NixlPush "nixl"  - the landing side READs them through NIXL from the sender's arena
fake.py: an in-memory pull for unit tests (FakePull over a FakeMedium both ends share).

`name` is the path's wire data_path, `label` the metric label of the bytes it carried, `streams`
whether those bytes travel on the control socket (then the connection is out of step while they are
partly sent, and fault injection can corrupt or cut them) rather than being fetched by the peer from
an arena the frame names by offsets. The control protocol (client.py, server.py, landing.py,
push.py) asks the path object for everything that differs, so adding or mocking a path is one class.

Calls flow one way: the server, the client, the landing store and the push sender import the
paths; a path imports none of them. Each end gets plain values and callables (ends.py): a source
end a `ReadContext` (store view, counters, log), a push sender the frame-sending callable, a push
receiver the row size and a receive-buffer lender. Shared protocol terms are in ../protocol.py.

The names below are the package's face, each defined once in its medium's module.
"""

from kvconnectors.transport.paths.ends import (PULL_UNOFFERED, PUSH_UNOFFERED, Outgoing, PullPath, PushFrame,
                                               PushPath, ReadContext, StoreView, offered)
from kvconnectors.transport.paths.nixl import NIXL_BOUNCE_BYTES, NixlPull, NixlPush
from kvconnectors.transport.paths.nixl_device import NixlDevicePull
from kvconnectors.transport.paths.shm import SHM_PULL, ShmPull
from kvconnectors.transport.paths.tcp import TCP_HEADS_PULL, TCP_PULL, TCP_PUSH, TcpHeadsPull, TcpPull, TcpPush

__all__ = ["NIXL_BOUNCE_BYTES", "PULL_UNOFFERED", "PUSH_UNOFFERED", "SHM_PULL", "TCP_HEADS_PULL", "TCP_PULL",
           "TCP_PUSH", "NixlDevicePull", "NixlPull", "NixlPush", "Outgoing", "PullPath", "PushFrame", "PushPath",
           "ReadContext", "ShmPull", "StoreView", "TcpHeadsPull", "TcpPull", "TcpPush", "offered"]
