"""RDMA endpoints: RC queue pairs to peers' NICs, connected over the TCP control channel.

An `RdmaEndpoint` is one path of the RDMA transport: an RC queue pair from a local NIC
to one of the peer's NICs, made on first use. Its attributes (QPN, PSN, GID, LID, MTU)
go to the peer over the TCP control channel (protocol.Op.RDMA_CONNECT, authenticated by
the segment's access key); the peer makes its own queue pair (a `PassiveQp`), and both
move INIT -> RTR -> RTS. Closing an endpoint destroys its queue pair and tells the peer
(RDMA_DISCONNECT) to destroy its side.
"""

from __future__ import annotations

import asyncio
import random
from typing import Awaitable, Callable

from mooncaked.log import get_logger

from .protocol import Op
from .rdma_nic import RdmaNic, RdmaPathError
from .segment import NicInfo, PeerSegment

log = get_logger(__name__)

ControlCall = Callable[[PeerSegment, Op, dict], Awaitable[dict]]
"""control(peer, op, body) -> the peer's JSON answer (tcp.TcpTransport.control)."""

class RdmaEndpoint:
    """One RC queue pair from a local NIC to a peer's NIC, connected on first use.

    Args:
        nic: the local NIC; peer: the peer's segment; remote: the peer's NIC to reach.
        control: the control call (RDMA_CONNECT / RDMA_DISCONNECT over TCP).
        instance: this engine's instance id (names our side of the pair to the peer).

    `users` counts slices using it (the pool never evicts a busy endpoint); `broken` is
    set by an error completion (the queue pair is then in the error state).
    """

    def __init__(self, nic: RdmaNic, peer: PeerSegment, remote: NicInfo, control: ControlCall,
                 instance: str):
        self.nic, self.peer, self.remote = nic, peer, remote
        self._control, self._instance = control, instance
        self.users = 0
        self.closed = False
        self.broken = False
        self.qp = None
        self.remote_qpn = 0
        self._connect_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(nic.max_send_wr)

    async def ensure_connected(self) -> None:
        """Makes the QP and exchanges attributes over the control channel (once).

        Raises: RdmaPathError; the control channel's ConnectionError/OSError/Refused.
        """
        async with self._connect_lock:
            if self.closed:
                raise RdmaPathError("endpoint closed")
            if self.qp is not None:
                return
            qp = self.nic.create_qp()
            psn = random.getrandbits(24)
            body = {"instance": self._instance, "nic": self.remote.name,
                    **self.nic.local_info(qp, psn)}
            try:
                reply = await self._control(self.peer, Op.RDMA_CONNECT, body)
                self.nic.connect_qp(qp, psn, reply)
            except BaseException:
                qp.close()
                raise
            self.qp, self.remote_qpn = qp, int(reply["qpn"])
            log.debug("rdma_endpoint_connected", nic=self.nic.name, peer=self.peer.node,
                      remote_nic=self.remote.name, qpn=qp.qp_num, remote_qpn=self.remote_qpn)

    async def transfer(self, read: bool, laddr: int, lkey: int, length: int, raddr: int,
                       rkey: int) -> None:
        """One RDMA READ/WRITE; returns when it completed. Raises RdmaPathError/RdmaAccessError."""
        async with self._slots:
            if self.closed or self.broken:
                raise RdmaPathError("endpoint broken")
            fut = self.nic.post(self, read, laddr, lkey, length, raddr, rkey)
            try:
                await fut
            except asyncio.CancelledError:
                # The work request may still run and touch the caller's buffer: destroying
                # the queue pair stops it before the buffer is handed back.
                self.close()
                raise

    def close(self) -> None:
        """Destroys the QP and tells the peer to destroy its side (dropped on both sides)."""
        if self.closed:
            return
        self.closed = True
        self.nic.fail_pending(self, "endpoint closed")
        if self.qp is not None:
            self.qp.close()
            body = {"instance": self._instance, "qpn": self.qp.qp_num}
            self.qp = None
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.create_task(self._notify_peer(body))

    async def _notify_peer(self, body: dict) -> None:
        try:
            await self._control(self.peer, Op.RDMA_DISCONNECT, body)
        except Exception as e:  # noqa: BLE001 - the peer may be gone; its QP then dies with it
            log.debug("rdma_disconnect_not_delivered", peer=self.peer.node, error=str(e))


class PassiveQp:
    """The server side of a peer's endpoint: a QP that only answers one-sided operations
    (pooled by the RDMA transport under (peer instance, peer QPN))."""

    def __init__(self, qp):
        self.qp = qp
        self.users = 0
        self.closed = False

    def close(self) -> None:
        """Destroys the queue pair (idempotent)."""
        if not self.closed:
            self.closed = True
            self.qp.close()


__all__ = ["RdmaEndpoint", "PassiveQp", "ControlCall"]
