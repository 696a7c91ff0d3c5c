"""mooncaked.transfer: the transfer engine (Mooncake paper section 3.2.3, Listing 1).

Moves bytes between this node's buffers and named segments on other nodes:

- engine.py: `TransferEngine` (segments, peers, batch API: allocate_batch_id,
  submit_transfer, get_transfer_status, wait_batch, free_batch_id; read/write)
- batch.py: `TransferRequest`, `TransferOp`, `TransferState`, `TransferStatus`, errors
- segment.py: local segments, descriptors (what peers need to reach a segment)
- protocol.py / tcp.py: the TCP data protocol, data server and client endpoints
- rdma.py: RC queue pairs through pyverbs (lazily imported), completions on the loop
- topology.py: preferred/secondary NICs per memory location; pool.py + sieve.py:
  the endpoint pool with SIEVE eviction
- peer.py: a stand-alone peer process (tests, benchmarks, manual checks)
"""

from .batch import (TransferError, TransferOp, TransferRequest, TransferState, TransferStatus,
                    UnknownSegmentError)
from .engine import TransferEngine
from .rdma import RdmaUnavailable

__all__ = ["TransferEngine", "TransferRequest", "TransferOp", "TransferState", "TransferStatus",
           "TransferError", "UnknownSegmentError", "RdmaUnavailable"]
