"""RDMA verbs layer: pyverbs (imported lazily), device discovery, and one opened NIC port.

pyverbs is rdma-core's Python binding. It is imported only when the RDMA transport is
asked for: RDMA hosts get it from their distribution's rdma-core (Debian:
python3-pyverbs; `mooncaked/transfer/install_pyverbs.sh` makes just that package
visible to a venv). On a host without RDMA devices `list_devices()` raises
RdmaUnavailable("no RDMA device found ...") and the engine uses TCP.

Per NIC (device port, `RdmaNic`): one protection domain, one completion channel + CQ
shared by every queue pair on that NIC, and one memory region per registered segment
(local write, remote read, remote write). Work requests are signaled one-sided RDMA
READ / RDMA WRITE; each completion resolves an asyncio future. Completions reach the
loop through the completion channel's file descriptor (loop.add_reader): no polling
thread, no busy loop.

Not exercised on machines without RDMA hardware; docs/transfer.md describes a manual
check with soft-RoCE (rxe).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING

from mooncaked.log import get_logger

from .segment import LocalSegment

if TYPE_CHECKING:
    from .rdma_endpoint import RdmaEndpoint

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
        """What the peer needs to connect to `qp`: {qpn, psn, gid, lid, mtu}."""
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
        """Stops watching completions and closes the device context (and all made on it)."""
        try:
            self.loop.remove_reader(self.fd)
        except (ValueError, OSError):
            pass
        self.ctx.close()  # closes CQ, channel, MRs, PD, QPs made on it


__all__ = ["RdmaUnavailable", "RdmaPathError", "RdmaAccessError", "load_pyverbs", "list_devices",
           "rtr_rts_attr", "RdmaNic", "CQ_DEPTH", "MAX_SEND_WR", "MAX_RD_ATOMIC"]
