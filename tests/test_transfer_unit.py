"""Transfer engine pieces in one process: SIEVE, topology, wire format, descriptors, buffers,
config, and the batch API against local segments (no peers)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mooncaked.config import ConfigError, TransferSettings, load_settings
from mooncaked.transfer import (TransferEngine, TransferError, TransferOp, TransferRequest,
                                TransferState, UnknownSegmentError)
from mooncaked.transfer.protocol import (REQUEST, Op, ProtocolError, Status, pack_request,
                                         pack_response, unpack_request, unpack_response)
from mooncaked.transfer.segment import (LocalSegment, as_byte_view, make_descriptor,
                                        parse_descriptor)
from mooncaked.transfer.sieve import SieveCache
from mooncaked.transfer.topology import Topology, detect_nics, parse_override


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# ---------------------------------------------------------------------------- SIEVE

def test_sieve_evicts_unvisited_oldest_first_and_keeps_visited():
    c = SieveCache(3)
    for k in "abc":
        c.put(k, k.upper())
    assert c.get("a") == "A"  # visited: survives the next eviction
    assert c.put("d", "D") == [("b", "B")]
    assert "a" in c and "b" not in c
    # The hand stays after "b" and keeps moving towards newer entries: "c", then "d".
    assert c.put("e", "E") == [("c", "C")]
    assert c.put("f", "F") == [("d", "D")]
    # Visited "e" and "f" lose their bits; the hand wraps to the oldest, "a" (its bit
    # was cleared on the first pass), and evicts it.
    c.get("e")
    c.get("f")
    assert c.put("g", "G") == [("a", "A")]
    assert sorted(k for k, _ in c.items()) == ["e", "f", "g"]


def test_sieve_skips_unevictable_and_grows_when_all_busy():
    busy = {"a", "b"}
    c = SieveCache(2, evictable=lambda v: v not in busy)
    c.put("a", "a")
    c.put("b", "b")
    assert c.put("c", "c") == []  # nothing evictable: over capacity rather than block
    assert len(c) == 3
    busy.clear()
    assert [k for k, _ in c.trim()] == ["a"]  # back within capacity once idle
    evicted = c.put("d", "d")
    assert len(evicted) == 1 and len(c) == 2 and "d" in c
    assert c.pop("d") == "d" and c.pop("d") is None
    with pytest.raises(ValueError):
        SieveCache(0)


# ---------------------------------------------------------------------------- topology

def _fake_sysfs(tmp_path, nics: dict[str, str]):
    root = tmp_path / "infiniband"
    for name, numa in nics.items():
        (root / name / "device").mkdir(parents=True)
        (root / name / "device" / "numa_node").write_text(numa + "\n")
    return root


def test_topology_from_sysfs_prefers_same_numa_and_rotates(tmp_path):
    root = _fake_sysfs(tmp_path, {"mlx5_0": "0", "mlx5_1": "0", "mlx5_2": "1", "rxe0": "x"})
    nics = detect_nics(root)
    assert nics == {"mlx5_0": 0, "mlx5_1": 0, "mlx5_2": 1, "rxe0": -1}
    topo = Topology.build(nics)
    assert topo.row("cpu:0") == (["mlx5_0", "mlx5_1"], ["mlx5_2", "rxe0"])
    assert topo.row("cpu:1") == (["mlx5_2"], ["mlx5_0", "mlx5_1", "rxe0"])
    first = [topo.paths("cpu:0")[0] for _ in range(4)]
    assert first == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]  # slices spread over preferred
    assert topo.paths("cpu:0")[2:] == ["mlx5_2", "rxe0"]     # then the secondary ones
    assert topo.row("cuda:3")[0] == ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0"]  # no row: all
    assert detect_nics(tmp_path / "absent") == {}


def test_topology_override_and_its_errors(tmp_path):
    nics = {"a": 0, "b": 1}
    topo = Topology.build(nics, {"cpu:0": [["b"], ["a"]], "cuda:0": [["a"]]})
    assert topo.row("cpu:0") == (["b"], ["a"])
    assert topo.row("cuda:0") == (["a"], [])
    assert Topology.build(nics, {"cpu:0": [["zz"]]}).row("cpu:0")[0] == ["a", "b"]
    for bad in ({"gpu0": [["a"]]}, {"cpu:0": ["a"]}, {"cpu:0": [["a"], ["b"], ["c"]]}):
        with pytest.raises(ValueError):
            parse_override(bad)


# ---------------------------------------------------------------------------- wire format

def test_wire_format_round_trip_and_bad_magic():
    key = bytes(range(16))
    frame = pack_request(Op.WRITE, b"n/dram", 7, 1 << 40, key)
    assert len(frame) == REQUEST.size + len(b"n/dram")
    assert unpack_request(frame[:REQUEST.size]) == (Op.WRITE, 6, 7, 1 << 40, key)
    assert unpack_response(pack_response(Status.OUT_OF_BOUNDS, 12)) == (Status.OUT_OF_BOUNDS, 12)
    with pytest.raises(ProtocolError):
        unpack_request(b"\0" * REQUEST.size)
    with pytest.raises(ProtocolError):
        unpack_response(b"GET / HTTP/1.1\r\n")


# ---------------------------------------------------------------------------- segments

def test_descriptor_round_trip_and_validation():
    seg = LocalSegment("n/dram", memoryview(bytearray(100)), "cpu:0")
    desc = make_descriptor(seg, node="n", instance="i1", host="127.0.0.1", port=9000)
    peer = parse_descriptor(desc)
    assert (peer.name, peer.length, peer.port, peer.access_key) == ("n/dram", 100, 9000,
                                                                    seg.access_key)
    assert peer.nics == ()
    for field, value, word in (("port", 0, "port"), ("access_key", "zz", "access_key"),
                               ("length", "10", "length"), ("location", "tpu:0", "location")):
        bad = dict(desc, **{field: value})
        with pytest.raises(ValueError, match=word):
            parse_descriptor(bad)
    with pytest.raises(ValueError, match="lacks 'host'"):
        parse_descriptor({k: v for k, v in desc.items() if k != "host"})


def test_byte_views_share_memory():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    v = as_byte_view(t, writable=True)
    assert v.nbytes == 12 and v.format == "B"
    v[0:2] = b"\x80\x3f"  # bf16 1.0
    assert t[0, 0].item() == 1.0
    with pytest.raises(ValueError, match="contiguous"):
        as_byte_view(t.t(), writable=True)
    with pytest.raises(ValueError, match="read-only"):
        as_byte_view(b"abc", writable=True)
    assert as_byte_view(b"abc", writable=False).tobytes() == b"abc"
    assert as_byte_view(np.zeros((4, 4), dtype=np.float32), writable=True).nbytes == 64
    with pytest.raises(TypeError):
        as_byte_view(object(), writable=False)


# ---------------------------------------------------------------------------- config

def test_transfer_config_section(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[transfer]\nbackend = "tcp"\nslice_size_bytes = 65536\n'
                 'nic_topology = {"cpu:0" = [["mlx5_0"], ["mlx5_1"]]}\n')
    s = load_settings(f).transfer
    assert (s.backend, s.slice_size_bytes) == ("tcp", 65536)
    assert s.nic_topology == {"cpu:0": [["mlx5_0"], ["mlx5_1"]]}
    f.write_text('[transfer]\nbackend = "infiniband"\n')
    with pytest.raises(ConfigError, match="transfer.backend"):
        load_settings(f)


# ---------------------------------------------------------------------------- batch API, local

def test_batch_api_against_a_local_segment():
    async def main():
        async with TransferEngine(TransferSettings(backend="tcp"), node_id="n") as eng:
            pool = bytearray(4096)
            desc = eng.register_segment("n/dram", pool)
            assert desc["length"] == 4096 and desc["port"] == eng.port > 0
            src = bytes(range(256)) * 2
            bid = eng.allocate_batch_id(3)
            eng.submit_transfer(bid, [
                TransferRequest(TransferOp.WRITE, "n/dram", 100, src),
                TransferRequest(TransferOp.WRITE, "n/dram", 4000, src),          # past the end
                TransferRequest(TransferOp.WRITE, "nobody/dram", 0, src)])        # unknown
            statuses = await eng.wait_batch(bid, timeout=10)
            assert [s.state for s in statuses] == [TransferState.DONE, TransferState.FAILED,
                                                  TransferState.FAILED]
            assert statuses[0].bytes == 512
            assert "out of bounds" in statuses[1].reason
            assert "unknown segment 'nobody/dram'" in statuses[2].reason
            assert eng.get_transfer_status(bid, 0).done
            with pytest.raises(ValueError, match="at most 3"):
                eng.submit_transfer(bid, [TransferRequest(TransferOp.READ, "n/dram", 0,
                                                          bytearray(1))])
            eng.free_batch_id(bid)
            with pytest.raises(KeyError):
                eng.get_transfer_status(bid)
            assert pool[100:612] == src
            dst = torch.zeros(128, dtype=torch.int32)  # READ into a tensor, by its bytes
            await eng.read("n/dram", 100, dst)
            assert dst.numpy().tobytes() == src
            # A local buffer may also be named by its registered segment.
            await eng.transfer([TransferRequest(TransferOp.READ, "n/dram", 100, "n/dram",
                                                local_offset=2048, length=512)])
            assert pool[2048:2560] == src
            with pytest.raises(TransferError, match="out of bounds"):
                await eng.write("n/dram", 4095, b"xy")
            with pytest.raises(ValueError, match="read-only"):
                await eng.read("n/dram", 0, b"immutable")
            with pytest.raises(ValueError, match="exceeds the local buffer"):
                await eng.read("n/dram", 0, bytearray(4), length=8)
            with pytest.raises(ValueError, match="already registered"):
                eng.register_segment("n/dram", bytearray(1))
            with pytest.raises(UnknownSegmentError):
                await eng.open_segment("elsewhere/dram")
            assert (await eng.open_segment("n/dram"))["local"] is True
            eng.unregister_segment("n/dram")
            with pytest.raises(UnknownSegmentError):
                eng.segment_descriptor("n/dram")

    run(main())


def test_free_batch_refuses_pending_and_register_needs_start():
    async def main():
        eng = TransferEngine(TransferSettings(backend="tcp"))
        with pytest.raises(RuntimeError, match="not running"):
            eng.register_segment("x", bytearray(8))
        await eng.start()
        try:
            eng.register_segment("x", bytearray(1 << 20))
            bid = eng.allocate_batch_id()
            eng.submit_transfer(bid, [TransferRequest(TransferOp.READ, "x", 0,
                                                      bytearray(1 << 20))])
            with pytest.raises(RuntimeError, match="pending"):
                eng.free_batch_id(bid)  # submitted, not yet run: still pending
            assert (await eng.wait_batch(bid, timeout=10))[0].done
            eng.free_batch_id(bid)
        finally:
            await eng.close()

    run(main())


def test_resolver_feeds_open_segment():
    published: dict[str, dict] = {}
    asked = []

    async def resolver(name):
        asked.append(name)
        return published.get(name)

    async def main():
        async with TransferEngine(TransferSettings(backend="tcp"), node_id="a",
                                  resolver=resolver) as a, \
                TransferEngine(TransferSettings(backend="tcp"), node_id="b") as b:
            mem = bytearray(b"x" * 64)
            published["b/dram"] = b.register_segment("b/dram", mem)
            info = await a.open_segment("b/dram")
            assert info == {"name": "b/dram", "length": 64, "location": "cpu:0",
                            "local": False, "node": "b"}
            await a.write("b/dram", 8, b"hello")  # over TCP between the two engines
            assert bytes(mem[8:13]) == b"hello"
            with pytest.raises(UnknownSegmentError):
                await a.open_segment("c/dram")
            assert asked == ["b/dram", "c/dram"]

    run(main())


def test_control_channel_round_trip():
    """RDMA_CONNECT/RDMA_DISCONNECT travel over the data server to a coroutine on the loop
    (the queue-pair exchange uses exactly this path), refusals included."""
    from mooncaked.transfer.protocol import ControlError, Refused
    from mooncaked.transfer.tcp_endpoint import TcpEndpoint
    from mooncaked.transfer.tcp_server import DataServer

    async def main():
        seg = LocalSegment("n/dram", memoryview(bytearray(16)), "cpu:0")
        seen = []

        async def control(op, segment, body):
            seen.append((op, segment.name, body))
            if body.get("nic") == "nope":
                raise ControlError(Status.BAD_REQUEST, "no RDMA NIC named 'nope'")
            return {"qpn": body["qpn"] + 1, "echo": body}

        server = DataServer("127.0.0.1", 0, {"n/dram": seg}.get, control)
        await server.start()
        ep = TcpEndpoint("127.0.0.1", server.port)
        try:
            reply = await ep.control(Op.RDMA_CONNECT, b"n/dram", seg.access_key,
                                     {"qpn": 41, "nic": "mlx5_0"})
            assert reply == {"qpn": 42, "echo": {"qpn": 41, "nic": "mlx5_0"}}
            with pytest.raises(Refused, match="bad_request: no RDMA NIC named 'nope'"):
                await ep.control(Op.RDMA_CONNECT, b"n/dram", seg.access_key,
                                 {"qpn": 1, "nic": "nope"})
            with pytest.raises(Refused, match="access key mismatch"):
                await ep.control(Op.RDMA_DISCONNECT, b"n/dram", b"\0" * 16, {"qpn": 1})
            assert await ep.control(Op.RDMA_DISCONNECT, b"n/dram", seg.access_key,
                                    {"qpn": 42}) == {"qpn": 43, "echo": {"qpn": 42}}
            assert [(op, name) for op, name, _ in seen] == [
                (Op.RDMA_CONNECT, "n/dram"), (Op.RDMA_CONNECT, "n/dram"),
                (Op.RDMA_DISCONNECT, "n/dram")]
            assert server.refused == 2
        finally:
            ep.close()
            await server.close()

    run(main())
