"""RDMA backend: reliable-connected queue pairs through pyverbs, driven by the asyncio loop.

pyverbs is rdma-core's Python binding. It is imported lazily, only when this
backend is asked for: RDMA hosts get it from their distribution's rdma-core
(Debian: python3-pyverbs; `mooncaked/transfer/install_pyverbs.sh` makes just that
package visible to a venv). On a host without RDMA devices `list_devices()` raises
RdmaUnavailable("no RDMA device found ...") and the engine uses TCP.

Per NIC (device port): one protection domain, one completion channel + CQ shared
by every queue pair on that NIC, and one memory region per registered segment
(local write, remote read, remote write). Per endpoint: one RC queue pair. Its
attributes (QPN, PSN, GID, LID, MTU) are exchanged with the peer over the TCP
control channel (protocol.Op.RDMA_CONNECT), then both sides move their QP
INIT -> RTR -> RTS. Transfers are one-sided RDMA READ / RDMA WRITE work requests
carrying the peer segment's rkey; each is signaled, and its completion resolves an
asyncio future. Completions reach the loop through the completion channel's file
descriptor (loop.add_reader): no polling thread, no busy loop.

Not exercised on machines without RDMA hardware; docs/transfer.md describes a manual
check with soft-RoCE (rxe).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
import random
from types import SimpleNamespace
from typing import Awaitable, Callable

from mooncaked.log import get_logger

from .protocol import Op, Status
from .segment import LocalSegment, NicInfo, PeerSegment
from .sieve import SieveCache
from .tcp import ControlError
from .topology import SYSFS_INFINIBAND, Topology, detect_nics

log = get_logger(__name__)

CQ_DEPTH = 4096
MAX_SEND_WR = 256          # outstanding work requests per queue pair (capped by the device)
MAX_RD_ATOMIC = 16         # outstanding RDMA READs per queue pair (capped by the device)
MIN_RNR_TIMER, TIMEOUT, RETRY_CNT, RNR_RETRY = 12, 14, 7, 7  # ibv_rc_pingpong's values
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class RdmaUnavailable(RuntimeError):
    """RDMA cannot be used here: pyverbs missing, no device, or no active port. Says which."""


class RdmaPathError(ConnectionError):
    """A work request failed on one path (QP error, flush, retry exceeded): try another path."""


class RdmaAccessError(RuntimeError):
    """The remote NIC refused an access (outside the memory region / bad rkey): do not retry."""


def load_pyverbs() -> SimpleNamespace:
    """Imports pyverbs' modules. Raises RdmaUnavailable when pyverbs is not installed."""
    try:
        import pyverbs.addr as addr  # noqa: PLC0415
        import pyverbs.cq as cq  # noqa: PLC0415
        import pyverbs.device as device  # noqa: PLC0415
        import pyverbs.enums as enums  # noqa: PLC0415
        import pyverbs.mr as mr  # noqa: PLC0415
        import pyverbs.pd as pd  # noqa: PLC0415
        import pyverbs.pyverbs_error as errors  # noqa: PLC0415
        import pyverbs.qp as qp  # noqa: PLC0415
        import pyverbs.wr as wr  # noqa: PLC0415
    except ImportError as e:
        raise RdmaUnavailable(f"pyverbs is not installed ({e}); install rdma-core's "
                              "python3-pyverbs (mooncaked/transfer/install_pyverbs.sh)") from e
    return SimpleNamespace(addr=addr, cq=cq, device=device, e=enums, mr=mr, pd=pd,
                           errors=errors, qp=qp, wr=wr)


def list_devices() -> list[str]:
    """Names of the RDMA devices pyverbs sees.

    Raises: RdmaUnavailable("no RDMA device found ...") when there are none (pyverbs raises
    "Failed to get devices list" on hosts without RDMA support in the kernel), or when
    pyverbs is missing.
    """
    pv = load_pyverbs()
    try:
        devices = pv.device.get_device_list()
    except pv.errors.PyverbsError as e:
        raise RdmaUnavailable(f"no RDMA device found (pyverbs: {e})") from e
    if not devices:
        raise RdmaUnavailable("no RDMA device found")
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def _event_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _find_channel_fd(before: set[int]) -> int:
    """The completion channel's fd: pyverbs does not expose it, so find the fd that appeared
    when the channel was made (the kernel names it anon_inode:[infinibandevent])."""
    new = sorted(_event_fds() - before)
    named = []
    for fd in new:
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{fd}"):
                named.append(fd)
        except OSError:
            pass
    if len(named) == 1:
        return named[0]
    if len(new) == 1:
        return new[0]
    raise RdmaUnavailable(f"cannot identify the completion channel's fd among {new}")


def rtr_rts_attr(pv: SimpleNamespace, *, port: int, local_psn: int, remote: dict, mtu: int,
                 sgid_index: int, is_global: bool, max_rd_atomic: int):
    """QPAttr for INIT -> RTR -> RTS of an RC queue pair towards `remote`.

    `remote` holds the peer's {qpn, psn, gid, lid}. Both RDMA READ directions need
    max_rd_atomic (as initiator) and max_dest_rd_atomic (as responder) >= 1.
    """
    attr = pv.qp.QPAttr(port_num=port)
    attr.path_mtu = mtu
    attr.dest_qp_num = int(remote["qpn"])
    attr.rq_psn = int(remote["psn"])            # what the peer sends with
    attr.sq_psn = local_psn                      # what we send with
    attr.max_dest_rd_atomic = max_rd_atomic
    attr.max_rd_atomic = max_rd_atomic
    attr.min_rnr_timer, attr.timeout = MIN_RNR_TIMER, TIMEOUT
    attr.retry_cnt, attr.rnr_retry = RETRY_CNT, RNR_RETRY
    gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(remote["gid"]), sgid_index=sgid_index)
    attr.ah_attr = pv.addr.AHAttr(port_num=port, is_global=1 if is_global else 0, gr=gr,
                                  dlid=int(remote["lid"]))
    return attr


class RdmaNic:
    """One opened RDMA device port: context, PD, completion channel + CQ, port facts.

    Raises (constructor): RdmaUnavailable when no port is active; pyverbs errors otherwise.
    """

    def __init__(self, pv: SimpleNamespace, name: str, gid_index: int,
                 loop: asyncio.AbstractEventLoop):
        self.pv, self.name, self.loop = pv, name, loop
        e = pv.e
        self.ctx = pv.device.Context(name=name)
        dev = self.ctx.query_device()
        self.port = 0
        for p in range(1, dev.phys_port_cnt + 1):
            if self.ctx.query_port(p).state == e.IBV_PORT_ACTIVE:
                self.port = p
                break
        if not self.port:
            self.ctx.close()
            raise RdmaUnavailable(f"RDMA device {name} has no active port")
        pattr = self.ctx.query_port(self.port)
        self.lid, self.mtu = pattr.lid, pattr.active_mtu
        self.is_ethernet = pattr.link_layer == e.IBV_LINK_LAYER_ETHERNET
        self.gid_index = gid_index if gid_index >= 0 else self._pick_gid(pattr.gid_tbl_len)
        self.gid = self.ctx.query_gid(self.port, self.gid_index).gid
        self.max_rd_atomic = max(1, min(MAX_RD_ATOMIC, dev.max_qp_rd_atom))
        self.max_send_wr = max(1, min(MAX_SEND_WR, dev.max_qp_wr))
        self.pd = pv.pd.PD(self.ctx)
        before = _event_fds()
        self.channel = pv.cq.CompChannel(self.ctx)
        self.fd = _find_channel_fd(before)
        # Non-blocking: a spurious wake-up then costs an EAGAIN, never a stalled loop.
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.cq = pv.cq.CQ(self.ctx, CQ_DEPTH, None, self.channel, 0)
        self.cq.req_notify()
        self._ids = itertools.count(1)
        self.pending: dict[int, tuple[asyncio.Future, "RdmaEndpoint"]] = {}
        loop.add_reader(self.fd, self._on_channel_event)

    def _pick_gid(self, table_len: int) -> int:
        """RoCE: the first RoCE v2 GID holding an IPv4 address, else the first RoCE v2 one;
        InfiniBand: index 0."""
        if not self.is_ethernet:
            return 0
        e = self.pv.e
        v2 = []
        for i in range(table_len):
            try:
                gid = self.ctx.query_gid(self.port, i).gid
                kind = self.ctx.query_gid_type(self.port, i)
            except self.pv.errors.PyverbsError:
                continue
            if gid == _ZERO_GID or kind != e.IBV_GID_TYPE_SYSFS_ROCE_V2:
                continue
            if gid.startswith(_IPV4_MAPPED):
                return i
            v2.append(i)
        return v2[0] if v2 else 0

    def info(self, rkey: int) -> dict:
        """This NIC's entry in a segment descriptor."""
        return {"name": self.name, "port": self.port, "gid": self.gid, "lid": self.lid,
                "mtu": self.mtu, "rkey": rkey}

    def register(self, seg: LocalSegment):
        """Registers the segment's memory (local write, remote read, remote write)."""
        e = self.pv.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return self.pv.mr.MR(self.pd, seg.length, access, address=seg.address)

    def create_qp(self):
        """An RC queue pair in INIT state, sharing this NIC's CQ, with remote read/write access."""
        pv, e = self.pv, self.pv.e
        cap = pv.qp.QPCap(max_send_wr=self.max_send_wr, max_recv_wr=1, max_send_sge=1,
                          max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                                sq_sig_all=0)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                                | e.IBV_ACCESS_REMOTE_WRITE)
        return pv.qp.QP(self.pd, init, attr)  # with a QPAttr, pyverbs leaves an RC QP in INIT

    def local_info(self, qp, psn: int) -> dict:
        return {"qpn": qp.qp_num, "psn": psn, "gid": self.gid, "lid": self.lid, "mtu": self.mtu}

    def connect_qp(self, qp, psn: int, remote: dict) -> None:
        """Moves `qp` INIT -> RTR -> RTS towards the peer described by `remote`."""
        attr = rtr_rts_attr(self.pv, port=self.port, local_psn=psn, remote=remote,
                            mtu=min(self.mtu, int(remote["mtu"])), sgid_index=self.gid_index,
                            is_global=self.is_ethernet, max_rd_atomic=self.max_rd_atomic)
        qp.to_rtr(attr)
        qp.to_rts(attr)

    def post(self, ep: "RdmaEndpoint", read: bool, laddr: int, lkey: int, length: int,
             raddr: int, rkey: int) -> asyncio.Future:
        """Posts one signaled RDMA READ/WRITE on `ep`'s queue pair; the future resolves on its
        completion. Raises RdmaPathError when the post itself fails."""
        pv, e = self.pv, self.pv.e
        wr_id = next(self._ids)
        sge = pv.wr.SGE(laddr, length, lkey)
        opcode = e.IBV_WR_RDMA_READ if read else e.IBV_WR_RDMA_WRITE
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                          send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey=rkey, addr=raddr)
        fut = self.loop.create_future()
        self.pending[wr_id] = (fut, ep)
        try:
            ep.qp.post_send(wr)
        except pv.errors.PyverbsError as exc:
            del self.pending[wr_id]
            raise RdmaPathError(f"{self.name}: post_send failed: {exc}") from exc
        return fut

    def _on_channel_event(self) -> None:
        pv = self.pv
        try:
            self.channel.get_cq_event(self.cq)
        except pv.errors.PyverbsError:  # EAGAIN: spurious wake-up
            return
        self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm first, then drain: no completion slips between
        while True:
            n, wcs = self.cq.poll(num_entries=64)
            if not n:
                break
            for wc in wcs[:n]:
                self._complete(wc)

    def _complete(self, wc) -> None:
        e = self.pv.e
        item = self.pending.pop(wc.wr_id, None)
        if item is None:
            return
        fut, ep = item
        if fut.done():
            return
        if wc.status == e.IBV_WC_SUCCESS:
            fut.set_result(None)
            return
        ep.broken = True  # any error leaves the RC queue pair in the error state
        what = self.pv.cq.cqe_status_to_str(wc.status)
        if wc.status == e.IBV_WC_REM_ACCESS_ERR:
            fut.set_exception(RdmaAccessError(f"remote NIC refused the access ({what})"))
        else:
            fut.set_exception(RdmaPathError(f"{self.name}: work request failed ({what})"))

    def fail_pending(self, ep: "RdmaEndpoint", reason: str) -> None:
        """Fails `ep`'s outstanding work requests (its queue pair is being destroyed)."""
        for wr_id, (fut, owner) in list(self.pending.items()):
            if owner is ep:
                del self.pending[wr_id]
                if not fut.done():
                    fut.set_exception(RdmaPathError(reason))

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
        except (ValueError, OSError):
            pass
        self.ctx.close()  # closes CQ, channel, MRs, PD, QPs made on it


ControlCall = Callable[[PeerSegment, Op, dict], Awaitable[dict]]


class RdmaEndpoint:
    """One RC queue pair from a local NIC to a peer's NIC, connected on first use."""

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


class _PassiveQp:
    """The server side of a peer's endpoint: a QP that only answers one-sided operations."""

    def __init__(self, qp):
        self.qp = qp
        self.users = 0
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.qp.close()


class RdmaBackend:
    """Every usable RDMA NIC of this node, the topology matrix, and the server-side QPs.

    Build with `RdmaBackend.open(...)`, which raises RdmaUnavailable with a plain reason.
    """

    def __init__(self, pv: SimpleNamespace, nics: dict[str, RdmaNic], topology: Topology,
                 max_endpoints: int):
        self.pv, self.nics, self.topology = pv, nics, topology
        self._passive: SieveCache[tuple[str, int], _PassiveQp] = SieveCache(max_endpoints)

    @classmethod
    def open(cls, *, gid_index: int = -1, nic_topology: dict | None = None,
             max_endpoints: int = 256, sysfs_root: str = SYSFS_INFINIBAND) -> "RdmaBackend":
        """Opens every RDMA device with an active port.

        Raises: RdmaUnavailable ("pyverbs is not installed", "no RDMA device found", "no RDMA
        device has an active port").
        """
        pv = load_pyverbs()
        names = list_devices()
        loop = asyncio.get_running_loop()
        nics: dict[str, RdmaNic] = {}
        problems = []
        for name in names:
            try:
                nics[name] = RdmaNic(pv, name, gid_index, loop)
            except (RdmaUnavailable, pv.errors.PyverbsError) as e:
                problems.append(f"{name}: {e}")
        if not nics:
            raise RdmaUnavailable("no RDMA device has an active port (" + "; ".join(problems) + ")")
        numa = detect_nics(sysfs_root)
        topo = Topology.build({n: numa.get(n, -1) for n in nics}, nic_topology, set(nics))
        log.info("rdma_backend_ready", nics=list(nics), topology=topo.to_dict(),
                 skipped=problems)
        return cls(pv, nics, topo, max_endpoints)

    def register(self, seg: LocalSegment) -> None:
        """Registers `seg` with every NIC (seg.rdma[nic] = memory region)."""
        if seg.length == 0:
            return
        for name, nic in self.nics.items():
            seg.rdma[name] = nic.register(seg)

    def unregister(self, seg: LocalSegment) -> None:
        for mr in seg.rdma.values():
            mr.close()
        seg.rdma.clear()

    def nic_descriptors(self, seg: LocalSegment) -> list[dict]:
        """Descriptor entries for `seg`: its location's preferred NICs first."""
        if not seg.rdma:
            return []
        pref, sec = self.topology.row(seg.location)
        order = pref + [n for n in sec if n not in pref]
        order += [n for n in self.nics if n not in order]
        return [self.nics[n].info(seg.rdma[n].rkey) for n in order if n in seg.rdma]

    async def handle_control(self, op: Op, seg: LocalSegment, body: dict) -> dict:
        """Server side of the control channel: make/destroy the passive QP of a peer's endpoint.

        Raises: ControlError (BAD_REQUEST) for a malformed body or an unknown NIC.
        """
        try:
            if op == Op.RDMA_DISCONNECT:
                qp = self._passive.pop((str(body["instance"]), int(body["qpn"])))
                if qp is not None:
                    qp.close()
                return {}
            nic = self.nics.get(str(body["nic"]))
            if nic is None:
                raise ControlError(Status.BAD_REQUEST, f"no RDMA NIC named {body['nic']!r}")
            remote = {k: body[k] for k in ("qpn", "psn", "gid", "lid", "mtu")}
            key = (str(body["instance"]), int(body["qpn"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ControlError(Status.BAD_REQUEST, f"malformed RDMA control body: {e!r}") from e
        qp = nic.create_qp()
        psn = random.getrandbits(24)
        try:
            nic.connect_qp(qp, psn, remote)
        except self.pv.errors.PyverbsError as e:
            qp.close()
            raise ControlError(Status.INTERNAL, f"cannot connect QP: {e}") from e
        for _, old in self._passive.put(key, _PassiveQp(qp)):
            old.close()
        return nic.local_info(qp, psn)

    def close(self) -> None:
        for _, qp in self._passive.items():
            qp.close()
        for nic in self.nics.values():
            nic.close()


__all__ = ["RdmaUnavailable", "RdmaPathError", "RdmaAccessError", "load_pyverbs", "list_devices",
           "rtr_rts_attr", "RdmaNic", "RdmaEndpoint", "RdmaBackend"]
