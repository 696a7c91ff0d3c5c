"""RDMA transport: one-sided RDMA READ/WRITE over RC queue pairs (pyverbs), TCP as fallback.

Every usable NIC port of this node (rdma_nic.RdmaNic), the topology matrix
(topology.py) that orders them per memory location, endpoints to peers' NICs
(rdma_endpoint.RdmaEndpoint, pooled in the engine's EndpointPool under ("rdma", peer
instance, local NIC, remote NIC)), and the passive queue pairs peers made with us.

A request whose local buffer lies inside a registered segment (so inside its memory
region) is cut into `rdma_slice_size_bytes` slices (slicing.run_sliced); each slice
starts on the next preferred NIC for the segment's location and the next of the peer's
NICs, so the slices of one request spread over them. A path that fails (error
completion, post failure, control channel error) is dropped on both sides and the slice
moves to the next NIC, ATTEMPTS at most, then to TCP. A remote access error is a
refusal, not retried. Requests on other buffers go over TCP.

The TCP transport carries the control channel: queue-pair attributes travel as
RDMA_CONNECT / RDMA_DISCONNECT requests, which its data server hands to
`handle_control` here.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from functools import partial
from types import SimpleNamespace

from mooncaked.config import TransferSettings
from mooncaked.log import get_logger

from .pool import EndpointPool
from .protocol import ControlError, Op, ProtocolError, Refused, Status
from .rdma_endpoint import PassiveQp, RdmaEndpoint
from .rdma_nic import (RdmaAccessError, RdmaNic, RdmaPathError, RdmaUnavailable, list_devices,
                       load_pyverbs)
from .segment import LocalSegment, PeerSegment, buffer_address
from .sieve import SieveCache
from .slicing import run_sliced
from .tcp import TcpTransport
from .topology import SYSFS_INFINIBAND, Topology, detect_nics
from .transport import ATTEMPTS, Progress, Transport, refused

log = get_logger(__name__)


class RdmaTransport(Transport):
    """Moves slices with RDMA READ/WRITE work requests; falls back to `tcp`.

    Build with `RdmaTransport.open(...)`, which raises RdmaUnavailable with a plain reason.

    Args:
        pv: the pyverbs modules (rdma_nic.load_pyverbs); nics: opened NICs by name;
        topology: the NIC matrix; settings: the `[transfer]` section
            (rdma_slice_size_bytes, max_endpoints); pool: the engine's endpoint pool;
        tcp: the TCP transport (control channel and fallback); instance: this engine's
            instance id (names our queue pairs to peers).
    """

    name = "rdma"

    def __init__(self, pv: SimpleNamespace, nics: dict[str, RdmaNic], topology: Topology,
                 settings: TransferSettings, pool: EndpointPool, tcp: TcpTransport,
                 instance: str):
        super().__init__(pool, settings.rdma_slice_size_bytes)
        self.pv, self.nics, self.topology = pv, nics, topology
        self._tcp, self._instance = tcp, instance
        self._passive: SieveCache[tuple[str, int], PassiveQp] = SieveCache(settings.max_endpoints)
        self._registered: dict[str, LocalSegment] = {}
        self._turn = itertools.count()

    @classmethod
    def open(cls, settings: TransferSettings, pool: EndpointPool, tcp: TcpTransport, *,
             instance: str, sysfs_root: str = SYSFS_INFINIBAND) -> "RdmaTransport":
        """Opens every RDMA device with an active port (rdma_gid_index, nic_topology from
        `settings`; NUMA nodes from `sysfs_root`).

        Raises: RdmaUnavailable ("pyverbs is not installed", "no RDMA device found", "no RDMA
        device has an active port"); ValueError for a malformed nic_topology.
        """
        pv = load_pyverbs()
        names = list_devices()
        loop = asyncio.get_running_loop()
        nics: dict[str, RdmaNic] = {}
        problems = []
        for name in names:
            try:
                nics[name] = RdmaNic(pv, name, settings.rdma_gid_index, loop)
            except (RdmaUnavailable, pv.errors.PyverbsError) as e:
                problems.append(f"{name}: {e}")
        if not nics:
            raise RdmaUnavailable("no RDMA device has an active port (" + "; ".join(problems) + ")")
        numa = detect_nics(sysfs_root)
        try:
            topo = Topology.build({n: numa.get(n, -1) for n in nics}, settings.nic_topology,
                                  set(nics))
        except ValueError:
            for nic in nics.values():
                nic.close()
            raise
        log.info("rdma_backend_ready", nics=list(nics), topology=topo.to_dict(),
                 skipped=problems)
        return cls(pv, nics, topo, settings, pool, tcp, instance)

    # ------------------------------------------------------------------ segments

    def register(self, seg: LocalSegment) -> None:
        """Registers `seg` with every NIC (seg.rdma[nic] = memory region). Raises
        pyverbs' PyverbsError when the NIC refuses the registration."""
        if seg.length == 0:
            return
        for name, nic in self.nics.items():
            seg.rdma[name] = nic.register(seg)
        self._registered[seg.name] = seg

    def unregister(self, seg: LocalSegment) -> None:
        """Deregisters `seg`'s memory regions."""
        self._registered.pop(seg.name, None)
        for mr in seg.rdma.values():
            mr.close()
        seg.rdma.clear()

    def segment_nics(self, seg: LocalSegment) -> list[dict]:
        """Descriptor entries for `seg`: its location's preferred NICs first."""
        if not seg.rdma:
            return []
        pref, sec = self.topology.row(seg.location)
        order = pref + [n for n in sec if n not in pref]
        order += [n for n in self.nics if n not in order]
        return [self.nics[n].info(seg.rdma[n].rkey) for n in order if n in seg.rdma]

    def _local_segment(self, peer: PeerSegment, view: memoryview) -> LocalSegment | None:
        """The registered segment holding `view` when the RDMA path applies, else None."""
        if not peer.nics or view.nbytes == 0:
            return None
        addr = buffer_address(view)
        for seg in self._registered.values():
            if seg.rdma and seg.contains(addr, view.nbytes):
                return seg
        return None

    # ------------------------------------------------------------------ server side

    async def handle_control(self, op: Op, seg: LocalSegment, body: dict) -> dict:
        """Server side of the control channel: make/destroy the passive QP of a peer's endpoint.

        Raises: ControlError (BAD_REQUEST) for a malformed body or an unknown NIC;
        ControlError (INTERNAL) when the queue pair cannot be connected.
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
        for _, old in self._passive.put(key, PassiveQp(qp)):
            old.close()
        return nic.local_info(qp, psn)

    async def close(self) -> None:
        """Deregisters every segment, destroys the passive QPs and closes the NICs."""
        for seg in list(self._registered.values()):
            self.unregister(seg)
        for _, qp in self._passive.items():
            qp.close()
        for nic in self.nics.values():
            nic.close()

    # ------------------------------------------------------------------ client side

    def drop_paths(self, peer: PeerSegment) -> int:
        """Drops every pooled queue pair to `peer`'s instance; returns how many."""
        return self.pool.drop_where(lambda k: k[0] == "rdma" and k[1] == peer.instance)

    def stats(self) -> dict:
        """slices_retried and rdma_nics (names of the opened NICs)."""
        return {"slices_retried": self.slices_retried, "rdma_nics": list(self.nics)}

    async def transfer(self, peer: PeerSegment, read: bool, view: memoryview,
                       remote_offset: int, progress: Progress) -> None:
        """A request in rdma_slice_size_bytes slices, or over TCP when `view` lies outside
        every registered segment (or the peer has no NICs). Raises TransferError."""
        local = self._local_segment(peer, view)
        if local is None:
            await self._tcp.transfer(peer, read, view, remote_offset, progress)
            return
        await run_sliced(view, remote_offset, self.slice_size,
                         partial(self._slice, peer, read, local), progress)

    async def move_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                         remote_offset: int) -> None:
        """One slice over RDMA (TCP when `part` is not in registered memory). Raises
        TransferError."""
        local = self._local_segment(peer, part)
        if local is None:
            await self._tcp.move_slice(peer, read, part, remote_offset)
            return
        await self._slice(peer, read, local, part, remote_offset)

    async def _slice(self, peer: PeerSegment, read: bool, local: LocalSegment, part: memoryview,
                     remote_offset: int) -> None:
        """One work request on the next NIC pair; the following NICs on failure, then TCP."""
        laddr = buffer_address(part)
        local_nics = self.topology.paths(local.location)
        turn = next(self._turn)
        for attempt, nic_name in enumerate(local_nics[:ATTEMPTS]):
            self.check_open()
            remote = peer.nics[(turn + attempt) % len(peer.nics)]
            pkey = ("rdma", peer.instance, nic_name, remote.name)
            ep = self.pool.get(pkey, lambda nic=self.nics[nic_name], rn=remote: RdmaEndpoint(
                nic, peer, rn, self._tcp.control, self._instance))
            ep.users += 1
            try:
                await ep.ensure_connected()
                await ep.transfer(read, laddr, local.rdma[nic_name].lkey, part.nbytes,
                                  peer.rdma_addr + remote_offset, remote.rkey)
                return
            except RdmaAccessError as e:
                self.pool.drop(pkey, ep)
                raise refused(peer, e, f"({remote.name})") from None
            except Refused as e:
                raise refused(peer, e) from None
            except (RdmaPathError, OSError, ConnectionError, ProtocolError,
                    self.pv.errors.PyverbsError) as e:
                self.slices_retried += 1
                self.pool.drop(pkey, ep)
                log.warning("rdma_path_failed", nic=nic_name, remote_nic=remote.name,
                            node=peer.node, error=str(e))
            finally:
                ep.users -= 1
        log.warning("rdma_paths_exhausted_using_tcp", node=peer.node)
        await self._tcp.move_slice(peer, read, part, remote_offset)


def open_rdma(settings: TransferSettings, pool: EndpointPool, tcp: TcpTransport, *,
              instance: str, sysfs_root: str = SYSFS_INFINIBAND
              ) -> tuple[RdmaTransport | None, str]:
    """The RDMA transport when transfer.backend allows it (auto, rdma) and the host can run
    it, wired to `tcp` (its data server then carries the RDMA control requests); else
    (None, the reason RDMA is not used: "" for backend tcp). Logs `rdma_unavailable`.

    Raises: RdmaUnavailable when transfer.require_rdma is set and RDMA is not usable;
    ValueError for a malformed nic_topology.
    """
    if settings.backend == "tcp":
        if settings.require_rdma:
            raise RdmaUnavailable("transfer.require_rdma is set but transfer.backend is 'tcp'")
        return None, ""
    try:
        rdma = RdmaTransport.open(settings, pool, tcp, instance=instance, sysfs_root=sysfs_root)
    except RdmaUnavailable as e:
        if settings.require_rdma:
            raise
        emit = log.warning if settings.backend == "rdma" else log.info
        emit("rdma_unavailable", reason=str(e), using="tcp")
        return None, str(e)
    tcp.serve_control(rdma.handle_control)
    return rdma, ""


__all__ = ["RdmaTransport", "open_rdma", "RdmaUnavailable", "RdmaPathError", "RdmaAccessError"]
