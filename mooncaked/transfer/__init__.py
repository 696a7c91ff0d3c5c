"""mooncaked.transfer: the transfer engine (Mooncake paper section 3.2.3, Listing 1).

Moves bytes between this node's buffers and named segments on other nodes:

- engine.py: `TransferEngine` (segments, peers, batch API: allocate_batch_id,
  submit_transfer, get_transfer_status, wait_batch, free_batch_id; read/write; the
  per-request deadline)
- batch.py: `TransferRequest`, `TransferOp`, `TransferState`, `TransferStatus`, errors,
  request validation; segment.py: local segments, descriptors (what peers need)
- transport.py: the `Transport` interface the engine drives (after Mooncake's Transport);
  slicing.py: the one helper that cuts a request into slices spread over paths
- tcp.py (`TcpTransport`), over tcp_endpoint.py (client connections), tcp_server.py (the
  data server) and protocol.py (the wire format)
- rdma.py (`RdmaTransport`), over rdma_endpoint.py (RC queue pairs) and rdma_nic.py
  (pyverbs, lazily imported; one NIC port, completions on the loop)
- local.py: requests on this engine's own segments (memcpy)
- topology.py: preferred/secondary NICs per memory location; pool.py + sieve.py:
  the endpoint pool with SIEVE eviction
- peer.py: a stand-alone peer process (tests, benchmarks, manual checks); selfcheck.py
"""

from .batch import (TransferError, TransferOp, TransferRequest, TransferState, TransferStatus,
                    UnknownSegmentError)
from .engine import TransferEngine
from .rdma_nic import RdmaUnavailable

__all__ = ["TransferEngine", "TransferRequest", "TransferOp", "TransferState", "TransferStatus",
           "TransferError", "UnknownSegmentError", "RdmaUnavailable"]
