"""Manual end-to-end check of the transfer engine between two local peer processes.

    python -m mooncaked.transfer.selfcheck [--backend rdma --require-rdma] [--host ADDR]

Starts two peers (`python -m mooncaked.transfer.peer`), hands each the other's
descriptor, makes each WRITE to and READ from the other (64 MiB by default, in both
directions), and compares SHA-256 digests of what landed with what was sent. Prints one
JSON object: the backend each peer runs, their RDMA NICs, the digests and "ok". On an
RDMA host (or soft-RoCE, see docs/transfer.md) run it with `--backend rdma
--require-rdma`: the peers then refuse to start unless RDMA works, and the transfers
go over RC queue pairs. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from .peer import PeerProcess, fill_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=("auto", "tcp", "rdma"))
    p.add_argument("--require-rdma", action="store_true")
    p.add_argument("--host", default="127.0.0.1", help="address both data servers use")
    p.add_argument("--bytes", type=int, default=64 << 20)
    args = p.parse_args(argv)
    n = args.bytes
    flags = ["--backend", args.backend, "--host", args.host, "--log-level", "info"]
    if args.require_rdma:
        flags.append("--require-rdma")
    try:
        a = PeerProcess("check-a", {"a/dram": 2 * n}, *flags, "--fill-seed", "1",
                        timeout_s=120)
    except RuntimeError as e:
        print(json.dumps({"ok": False, "error": str(e)}, indent=2))
        return 1
    try:
        b = PeerProcess("check-b", {"b/dram": 2 * n}, *flags, "--fill-seed", "2", timeout_s=120)
    except BaseException:
        a.stop()
        raise
    try:
        a.cmd(cmd="add_peer", descriptor=b.descriptors["b/dram"])
        b.cmd(cmd="add_peer", descriptor=a.descriptors["a/dram"])
        # a WRITEs its first half into b's second half; b READs a's second half into its first.
        w = a.cmd(cmd="transfer", op="write", local="a/dram", local_offset=0, segment="b/dram",
                  remote_offset=n, length=n)
        r = b.cmd(cmd="transfer", op="read", local="b/dram", local_offset=0, segment="a/dram",
                  remote_offset=n, length=n)
        seeds = {}
        for seed in (1, 2):
            buf = bytearray(2 * n)
            fill_bytes(memoryview(buf), seed)
            seeds[seed] = buf
        want_b_hi = hashlib.sha256(seeds[1][:n]).hexdigest()
        want_b_lo = hashlib.sha256(seeds[1][n:]).hexdigest()
        got_b_hi = b.cmd(cmd="sha256", segment="b/dram", offset=n, length=n)["sha256"]
        got_b_lo = b.cmd(cmd="sha256", segment="b/dram", offset=0, length=n)["sha256"]
        report = {
            "backends": [a.info["backend"], b.info["backend"]],
            "rdma_unavailable_reason": a.info["rdma_unavailable_reason"],
            "write": w, "read": r,
            "write_digest_ok": got_b_hi == want_b_hi, "read_digest_ok": got_b_lo == want_b_lo,
            "stats": [a.cmd(cmd="stats")["stats"], b.cmd(cmd="stats")["stats"]],
        }
        report["ok"] = (w["state"] == r["state"] == "done" and report["write_digest_ok"]
                        and report["read_digest_ok"])
        print(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    finally:
        a.stop()
        b.stop()


if __name__ == "__main__":
    sys.exit(main())
