"""RDMA backend on a host without RDMA devices: pyverbs imports, finds no device, says so
plainly, and the engine runs on TCP (or refuses to start when RDMA is required).

Needs Debian's pyverbs made visible to the venv (mooncaked/transfer/install_pyverbs.sh):
skipped, with that reason, without it (a failure under CI). Skipped too on a host that has
RDMA devices (the manual check in docs/transfer.md covers those).
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from mooncaked.config import TransferSettings
from mooncaked.transfer import RdmaUnavailable, TransferEngine
from mooncaked.transfer.peer import PeerProcess
from mooncaked.transfer.rdma_nic import list_devices, load_pyverbs, rtr_rts_attr

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pyverbs") is None,
    reason="pyverbs is not installed (run mooncaked/transfer/install_pyverbs.sh .venv)")


def _has_devices() -> bool:
    try:
        return bool(list_devices())
    except RdmaUnavailable:
        return False


# On a host with RDMA devices these skip (also under CI); docs/transfer.md's manual check
# covers such hosts.
no_devices = pytest.mark.rdma_devices(_has_devices(), reason="this host has RDMA devices")


@no_devices
def test_pyverbs_imports_and_finds_no_device():
    pv = load_pyverbs()
    assert hasattr(pv.qp, "QP") and hasattr(pv.cq, "CompChannel")
    with pytest.raises(RdmaUnavailable, match="^no RDMA device found"):
        list_devices()


@no_devices
def test_engine_falls_back_to_tcp_and_says_why():
    async def main():
        for backend in ("auto", "rdma"):
            async with TransferEngine(TransferSettings(backend=backend), node_id="a") as eng:
                assert eng.backend == "tcp"
                assert eng.rdma_unavailable_reason.startswith("no RDMA device found")
                desc = eng.register_segment("a/dram", bytearray(b"k" * 32))
                assert desc["transports"] == ["tcp"] and "rdma" not in desc

    asyncio.run(asyncio.wait_for(main(), 30))


@no_devices
def test_require_rdma_refuses_to_start():
    async def main():
        eng = TransferEngine(TransferSettings(require_rdma=True))
        with pytest.raises(RdmaUnavailable, match="no RDMA device found"):
            await eng.start()
        eng2 = TransferEngine(TransferSettings(backend="tcp", require_rdma=True))
        with pytest.raises(RdmaUnavailable, match="backend is 'tcp'"):
            await eng2.start()

    asyncio.run(asyncio.wait_for(main(), 30))
    with pytest.raises(RuntimeError, match="did not start: RdmaUnavailable: no RDMA device"):
        PeerProcess("b", {"b/dram": 4096}, "--require-rdma")


@no_devices
def test_auto_backend_peers_move_data_over_tcp():
    peer = PeerProcess("b", {"b/dram": 4096}, "--backend", "auto", "--fill-seed", "9")
    try:
        assert peer.info["backend"] == "tcp"
        assert peer.info["rdma_unavailable_reason"].startswith("no RDMA device found")

        async def main():
            async with TransferEngine(TransferSettings(backend="auto"), node_id="a") as eng:
                eng.add_peer_segment(peer.descriptors["b/dram"])
                await eng.write("b/dram", 10, b"over tcp")
                back = bytearray(8)
                await eng.read("b/dram", 10, back)
                assert back == b"over tcp"

        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        peer.stop()


def test_queue_pair_attributes_for_rtr_and_rts():
    """The INIT -> RTR -> RTS attributes carry the peer's QPN/PSN/GID (built without a device)."""
    pv = load_pyverbs()
    remote = {"qpn": 0x1234, "psn": 777, "gid": "fe80:0000:0000:0000:0202:c9ff:fe00:0001",
              "lid": 5, "mtu": 3}
    attr = rtr_rts_attr(pv, port=1, local_psn=42, remote=remote, mtu=3, sgid_index=1,
                        is_global=True, max_rd_atomic=16)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (0x1234, 777, 42)
    assert attr.path_mtu == 3 and attr.max_rd_atomic == 16 and attr.max_dest_rd_atomic == 16
    assert attr.ah_attr.dgid == remote["gid"] and attr.ah_attr.is_global == 1
    assert attr.ah_attr.sgid_index == 1 and attr.ah_attr.port_num == 1
